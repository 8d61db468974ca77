"""KV transfer checksums: over the bytes, whatever the dtype, and sensitive to one flipped bit."""

from __future__ import annotations

import pytest
import torch
import xxhash

from nori.transfer.integrity import buffer_checksum, first_mismatch


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.uint8])
def test_the_checksum_is_xxh3_of_the_bytes(dtype: torch.dtype) -> None:
    buffer = torch.arange(64, dtype=torch.float32).to(dtype)
    raw = bytes(buffer.view(torch.uint8).tolist())
    assert buffer_checksum(buffer) == xxhash.xxh3_64_intdigest(raw)


def test_one_flipped_bit_is_a_mismatch_naming_the_buffer() -> None:
    buffers = [torch.ones(4, 8), torch.ones(4, 8)]
    expected = [buffer_checksum(b) for b in buffers]
    assert first_mismatch(buffers, expected) is None
    buffers[1].view(-1).view(torch.uint8)[13] ^= 0x01
    assert first_mismatch(buffers, expected).startswith("buffer 1 has checksum")  # type: ignore[union-attr]
    assert first_mismatch(buffers, expected[:1]) == "1 checksums for 2 buffers"
    with pytest.raises(ValueError, match="contiguous"):
        buffer_checksum(torch.ones(4, 8).t())
