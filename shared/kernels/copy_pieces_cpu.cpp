// A KV transfer's copy out of a mapping of the sender's shared memory, piece by piece
// (nori.transfer.cross_memory_receiver): each row of `pieces` is (destination address, source
// address, byte count). In Python, a ctypes memmove per 32 KiB piece cost about a microsecond of
// call overhead and a hand-over of the GIL, so two copy threads ran no faster than one; here a
// whole 1 MiB chunk is one call, the GIL released throughout.
//
// copy_and_hash_pieces also takes the chunk's digest for the transfer checksum
// (nori.transfer.integrity.TransferHasher): xxh3-64 of the pieces' bytes in order, each
// stretch of at most HASH_STEP_BYTES hashed right after it is copied, while it is in L1/L2:
// hashing a chunk after copying all of it read it back from L3 or memory, and hashing from
// Python took the GIL per piece (4-6 ms per 64 MiB on two threads, against 1.2 ms of hashing).

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#define XXH_INLINE_ALL
#include "third_party/xxhash/xxhash.h"

namespace {

constexpr int64_t HASH_STEP_BYTES = 64 * 1024;

const int64_t* checked_rows(const torch::Tensor& pieces) {
  TORCH_CHECK(pieces.device().is_cpu() && pieces.scalar_type() == torch::kInt64 &&
                  pieces.dim() == 2 && pieces.size(1) == 3 && pieces.is_contiguous(),
              "pieces must be contiguous int64 [n, 3] on the CPU");
  const int64_t* rows = pieces.data_ptr<int64_t>();
  for (int64_t i = 0; i < pieces.size(0); ++i) {
    TORCH_CHECK(rows[3 * i + 2] >= 0, "a piece's byte count is negative");
  }
  return rows;
}

}  // namespace

void copy_pieces(const torch::Tensor& pieces) {
  const int64_t* row = checked_rows(pieces);
  for (int64_t i = 0; i < pieces.size(0); ++i, row += 3) {
    std::memcpy(reinterpret_cast<void*>(row[0]), reinterpret_cast<const void*>(row[1]),
                static_cast<size_t>(row[2]));
  }
}

uint64_t copy_and_hash_pieces(const torch::Tensor& pieces) {
  const int64_t* row = checked_rows(pieces);
  XXH3_state_t state;
  XXH3_64bits_reset(&state);
  for (int64_t i = 0; i < pieces.size(0); ++i, row += 3) {
    auto* destination = reinterpret_cast<char*>(row[0]);
    const auto* source = reinterpret_cast<const char*>(row[1]);
    for (int64_t done = 0; done < row[2]; done += HASH_STEP_BYTES) {
      const size_t step = static_cast<size_t>(std::min(HASH_STEP_BYTES, row[2] - done));
      std::memcpy(destination + done, source + done, step);
      XXH3_64bits_update(&state, destination + done, step);
    }
  }
  return XXH3_64bits_digest(&state);
}
