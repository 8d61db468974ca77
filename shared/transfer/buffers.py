"""Tensors as flat byte views, without copies, and the checks both ends make on them."""

from __future__ import annotations

import torch

from nori.transfer.base import TransferRejected
from nori.transfer.handoff import TransferHeader


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a uint8 tensor sharing its memory (any dtype, bfloat16 too).

    The shape is not flattened (that would cost another view per block, and blocks come by the
    thousand); `numel()` is the byte count. The caller has checked contiguity.
    """
    if tensor.dtype is torch.uint8:
        return tensor
    # view(dtype) reinterprets the bytes in place; it needs at least one dimension.
    return (tensor.view(1) if tensor.dim() == 0 else tensor).view(torch.uint8)


def check_sources(header: TransferHeader, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
    """The sender's buffers as byte views; ValueError when they do not match the header."""
    if len(buffers) != len(header.buffer_nbytes):
        raise ValueError(
            f"{len(buffers)} buffers for a header that lists {len(header.buffer_nbytes)}"
        )
    for index, (buffer, nbytes) in enumerate(zip(buffers, header.buffer_nbytes, strict=True)):
        if not buffer.is_contiguous():
            # A copy would be sent instead of the cache itself; make the caller decide.
            raise ValueError(f"buffer {index} is not contiguous")
        if buffer.nbytes != nbytes:
            raise ValueError(
                f"buffer {index} holds {buffer.nbytes} bytes, the header says {nbytes}"
            )
    return [byte_view(buffer) for buffer in buffers]


def check_destinations(
    header: TransferHeader, destinations: list[torch.Tensor]
) -> list[torch.Tensor]:
    """The sink's destinations as byte views; TransferRejected when they do not fit the header."""
    if len(destinations) != len(header.buffer_nbytes):
        raise TransferRejected(
            f"size mismatch: the receiver has {len(destinations)} destination buffers, "
            f"the header lists {len(header.buffer_nbytes)}"
        )
    for index, (tensor, nbytes) in enumerate(zip(destinations, header.buffer_nbytes, strict=True)):
        # Not contiguous would mean receiving into a temporary copy: not in place.
        if not isinstance(tensor, torch.Tensor) or not tensor.is_contiguous():
            raise TransferRejected(f"destination {index} is not a contiguous tensor")
        if tensor.nbytes != nbytes:
            raise TransferRejected(
                f"size mismatch: destination {index} holds {tensor.nbytes} bytes, "
                f"the header says {nbytes}"
            )
    return [byte_view(tensor) for tensor in destinations]
