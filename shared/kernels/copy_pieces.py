"""Copies of raw memory pieces, (destination address, source address, byte count) each, with
C++ kernels on CPU (copy_pieces_cpu.cpp) beside ctypes memmove references.

A kernel copies a whole chunk in one call with the GIL released. `copy_and_hash_pieces` also
returns the chunk's digest, hashing each stretch right after it is copied."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import xxhash

from nori.kernels.cpu_build import cpu_kernels


def copy_pieces_reference(pieces: np.ndarray) -> None:
    """memmove of each row of int64 [n, 3] (ctypes lets go of the GIL during each)."""
    for destination, source, nbytes in pieces.tolist():
        ctypes.memmove(destination, source, nbytes)


def copy_and_hash_pieces_reference(pieces: np.ndarray) -> int:
    """`copy_pieces_reference`, then xxh3-64 of the copied bytes in order."""
    copy_pieces_reference(pieces)
    hasher = xxhash.xxh3_64()
    for destination, _, nbytes in pieces.tolist():
        hasher.update(ctypes.string_at(destination, nbytes))
    return int(hasher.intdigest())


def _kernels_for(pieces: np.ndarray) -> Any | None:
    if pieces.dtype != np.int64 or not pieces.flags.c_contiguous:
        return None
    return cpu_kernels()


def copy_pieces(pieces: np.ndarray) -> None:
    """Copies each row of an int64 [n, 3] array; the caller vouches for every address."""
    kernels = _kernels_for(pieces)
    if kernels is None:
        copy_pieces_reference(pieces)
    else:
        kernels.copy_pieces(torch.from_numpy(pieces))


def copy_and_hash_pieces(pieces: np.ndarray) -> int:
    """`copy_pieces`, returning xxh3-64 of the copied bytes in order (a chunk digest)."""
    kernels = _kernels_for(pieces)
    if kernels is None:
        return copy_and_hash_pieces_reference(pieces)
    return int(kernels.copy_and_hash_pieces(torch.from_numpy(pieces)))


def copy_share_of_chunks(
    chunks: Sequence[np.ndarray],
    first: int,
    num_threads: int,
    digests: list[int] | None = None,
    stop: threading.Event | None = None,
) -> None:
    """One copy thread's share: chunks first, first + num_threads, ...; each chunk's digest goes
    to `digests[index]`, and a set `stop` ends it at the next chunk."""
    for index in range(first, len(chunks), num_threads):
        if stop is not None and stop.is_set():
            return
        if digests is None:
            copy_pieces(chunks[index])
        else:
            digests[index] = copy_and_hash_pieces(chunks[index])
