"""Tensors as flat byte views, without copies, and the checks both ends make on them."""

from __future__ import annotations

import torch

from nori.transfer.base import TransferRejected
from nori.transfer.handoff import TransferHeader


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a uint8 tensor sharing its memory; not flattened (`numel()` is the
    byte count). The caller has checked contiguity."""
    if tensor.dtype is torch.uint8:
        return tensor
    return (tensor.view(1) if tensor.dim() == 0 else tensor).view(torch.uint8)


def check_sources(header: TransferHeader, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
    """The sender's buffers as byte views; ValueError when they do not match the header."""
    if len(buffers) != len(header.buffer_nbytes):
        raise ValueError(
            f"{len(buffers)} buffers for a header that lists {len(header.buffer_nbytes)}"
        )
    for index, (buffer, nbytes) in enumerate(zip(buffers, header.buffer_nbytes, strict=True)):
        if not buffer.is_contiguous():
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
        if not isinstance(tensor, torch.Tensor) or not tensor.is_contiguous():
            raise TransferRejected(f"destination {index} is not a contiguous tensor")
        if tensor.nbytes != nbytes:
            raise TransferRejected(
                f"size mismatch: destination {index} holds {tensor.nbytes} bytes, "
                f"the header says {nbytes}"
            )
    return [byte_view(tensor) for tensor in destinations]


# Runs of adjacent buffers: each side states its runs (sender in the header, receiver in its
# acceptance), and both move each run adjacent on both sides as one message.


def adjacent_runs(views: list[torch.Tensor]) -> tuple[int, ...]:
    """The lengths, in order, of the runs of views adjacent in memory (one storage, each
    starting where the one before ends)."""
    runs: list[int] = []
    end = -1
    storage = -1
    for view in views:
        start = view.data_ptr()
        here = view.untyped_storage().data_ptr()
        if runs and start == end and here == storage and view.numel():
            runs[-1] += 1
        else:
            runs.append(1)
        end = start + view.numel() * view.element_size()
        storage = here
    return tuple(runs)


# The most bytes one run's message carries: small enough to be in L2 when its checksum is taken.
MAX_RUN_BYTES = 1024 * 1024


def joint_runs(
    first: tuple[int, ...],
    second: tuple[int, ...],
    buffer_nbytes: tuple[int, ...],
    max_run_bytes: int = MAX_RUN_BYTES,
) -> tuple[int, ...]:
    """The runs adjacent on both sides, cut so no run of several buffers holds more than
    `max_run_bytes`. Both sides know every input, so both cut the same messages."""
    ends = set(_run_ends(first)) | set(_run_ends(second))
    runs: list[int] = []
    run_bytes = 0
    for index, nbytes in enumerate(buffer_nbytes):
        if runs and runs[-1] and run_bytes + nbytes <= max_run_bytes:
            runs[-1] += 1
            run_bytes += nbytes
        else:
            runs.append(1)
            run_bytes = nbytes
        if index + 1 in ends:
            runs.append(0)  # the next buffer starts a run
            run_bytes = 0
    return tuple(run for run in runs if run)


def _run_ends(runs: tuple[int, ...]) -> list[int]:
    ends, position = [], 0
    for run in runs:
        position += run
        ends.append(position)
    return ends


def merge_runs(views: list[torch.Tensor], runs: tuple[int, ...]) -> list[torch.Tensor]:
    """One flat byte view per run, spanning its views' memory (no copy); `runs` must be runs
    of adjacent views."""
    if sum(runs) != len(views):
        raise ValueError(f"runs over {sum(runs)} buffers for {len(views)}")
    merged: list[torch.Tensor] = []
    start = 0
    for run in runs:
        first = views[start]
        if run == 1:
            merged.append(first)
        else:
            nbytes = sum(view.numel() for view in views[start : start + run])
            merged.append(first.as_strided((nbytes,), (1,), first.storage_offset()))
        start += run
    return merged
