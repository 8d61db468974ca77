// A KV transfer's copy out of a mapping of the sender's shared memory, piece by piece
// (nori.transfer.cross_memory_receiver): each row of `pieces` [n, 3] int64 is (destination
// address, source address, byte count). A whole chunk is one call, the GIL released throughout
// (a ctypes memmove per piece took the GIL back for each).
//
// copy_and_hash_pieces also takes the chunk's digest for the transfer checksum
// (nori.transfer.integrity.TransferHasher): xxh3-64 of the pieces' bytes in order, each
// stretch of at most HASH_STEP_BYTES hashed right after it is copied, while it is in L1/L2.

#define XXH_INLINE_ALL
#include "third_party/xxhash/xxhash.h"

#include "cpu_common.h"

namespace {

constexpr int64_t HASH_STEP_BYTES = 64 * 1024;

int check_rows(const int64_t* rows, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (rows[3 * i + 2] < 0) return nori::fail("a piece's byte count is negative");
  }
  return 0;
}

}  // namespace

// Copies each piece; with a digest, hashes the copied bytes in order into *digest (xxh3-64).
NORI_SIGNATURE(copy_pieces, "PPP");
extern "C" int nori_copy_pieces(const int64_t* rows, int64_t n, uint64_t* digest) {
  if (check_rows(rows, n) != 0) return 1;
  if (digest == nullptr) {
    for (int64_t i = 0; i < n; ++i, rows += 3) {
      std::memcpy(reinterpret_cast<void*>(rows[0]), reinterpret_cast<const void*>(rows[1]),
                  static_cast<size_t>(rows[2]));
    }
    return 0;
  }
  XXH3_state_t state;
  XXH3_64bits_reset(&state);
  for (int64_t i = 0; i < n; ++i, rows += 3) {
    auto* destination = reinterpret_cast<char*>(rows[0]);
    const auto* source = reinterpret_cast<const char*>(rows[1]);
    for (int64_t done = 0; done < rows[2]; done += HASH_STEP_BYTES) {
      const size_t step = static_cast<size_t>(std::min(HASH_STEP_BYTES, rows[2] - done));
      std::memcpy(destination + done, source + done, step);
      XXH3_64bits_update(&state, destination + done, step);
    }
  }
  *digest = XXH3_64bits_digest(&state);
  return 0;
}
