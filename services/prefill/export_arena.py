"""Shared memory a prefill worker copies each prefilled request's KV blocks into, to send them.

A copy in this arena (one segment for the worker's life) can be read by a same-host decode worker
out of its mapping; one that does not fit (first-fit over ALIGN-aligned ranges) is a private copy
sent as messages. A range goes back when its transfer ends, never while a receiver may read it."""

from __future__ import annotations

import bisect
import concurrent.futures
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from nori.engine.kv_cache import read_blocks
from nori.kernels.copy_pieces import copy_share_of_chunks
from nori.transfer.cross_memory_receiver import COPY_THREADS, copy_plan
from nori.transfer.integrity import CHECKSUM_CHUNK_BYTES, TransferHasher

# Every range starts on a page: tensors are aligned and no two share a page.
ALIGN = 4096
DEFAULT_EXPORT_ARENA_BYTES = 1024 * 1024 * 1024
SHARED_MEMORY_FOLDER = "/dev/shm"

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExportCopy:
    """A copy of a request's blocks (`nori.engine.kv_cache.read_blocks`' layout)."""

    blocks: tuple[torch.Tensor, ...]
    # Gives its range back (once nothing reads the copy); None: not in the arena.
    release: Callable[[], None] | None = None
    # The transfer checksum of its bytes, taken as it was copied; None: not taken.
    checksum: int | None = None


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class ByteRanges:
    """First-fit allocation of ALIGN-aligned ranges of [0, capacity); freed ranges merge with
    free neighbours. Pure bookkeeping."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity - capacity % ALIGN
        # Free (start, nbytes), sorted by start, never adjacent (merged).
        self._free: list[tuple[int, int]] = [(0, self.capacity)] if self.capacity else []

    @property
    def free_bytes(self) -> int:
        return sum(nbytes for _, nbytes in self._free)

    @property
    def free_ranges(self) -> list[tuple[int, int]]:
        return list(self._free)

    def allocate(self, nbytes: int) -> int | None:
        """The start of a range of at least `nbytes` (rounded up to ALIGN); None if none fits."""
        size = _aligned(max(nbytes, 1))
        for index, (start, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[index]
                else:
                    self._free[index] = (start + size, free - size)
                return start
        return None

    def free(self, start: int, nbytes: int) -> None:
        """Frees what `allocate(nbytes)` returned as `start`; ValueError unless wholly allocated."""
        size = _aligned(max(nbytes, 1))
        end = start + size
        index = bisect.bisect_left(self._free, (start, 0))
        before = self._free[index - 1] if index else None
        after = self._free[index] if index < len(self._free) else None
        if (
            start % ALIGN
            or start < 0
            or end > self.capacity
            or (before is not None and before[0] + before[1] > start)
            or (after is not None and after[0] < end)
        ):
            raise ValueError(f"bytes [{start}, {end}) are not an allocated range")
        if after is not None and after[0] == end:
            end += after[1]
            del self._free[index]
        if before is not None and before[0] + before[1] == start:
            start = before[0]
            index -= 1
            del self._free[index]
        self._free.insert(index, (start, end - start))


class ExportArena:
    def __init__(self, capacity_bytes: int = DEFAULT_EXPORT_ARENA_BYTES) -> None:
        self._ranges = ByteRanges(capacity_bytes)
        self._lock = threading.Lock()  # copies run on threads; releases on the event loop
        self._memory: torch.Tensor | None = None  # made on first use
        self._touched = 0
        self._full_logged = False
        self._copiers = concurrent.futures.ThreadPoolExecutor(
            COPY_THREADS, thread_name_prefix="nori-kv-export"
        )

    def _room_for(self, end: int) -> bool:
        """Whether /dev/shm has room for the arena's pages to `end` (else a write is a SIGBUS)."""
        if end <= self._touched:
            return True
        try:
            stats = os.statvfs(SHARED_MEMORY_FOLDER)
        except OSError:
            return False
        if stats.f_bavail * stats.f_frsize < end - self._touched:
            if not self._full_logged:
                self._full_logged = True
                logger.warning(
                    "%s has no room for more of the KV export arena: KV copies past %d MiB are "
                    "private (give the worker more shared memory, e.g. compose's shm_size)",
                    SHARED_MEMORY_FOLDER,
                    self._touched // 2**20,
                )
            return False
        self._touched = end
        return True

    @property
    def capacity(self) -> int:
        return self._ranges.capacity

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return self._ranges.free_bytes

    def read_blocks(self, tensors: Sequence[torch.Tensor], block_ids: list[int]) -> ExportCopy:
        """A copy of the blocks (`kv_cache.read_blocks`' layout) in the arena where it fits, with
        its release and its stream's transfer checksum; else a private copy alone."""
        shapes = [(*tensor.shape[:2], len(block_ids), *tensor.shape[3:]) for tensor in tensors]
        sizes = [
            _aligned(torch.Size(shape).numel() * tensor.element_size())
            for shape, tensor in zip(shapes, tensors, strict=True)
        ]
        total = sum(sizes)
        if (
            any(tensor.device.type != "cpu" or not tensor.is_contiguous() for tensor in tensors)
            or not total
        ):
            return ExportCopy(read_blocks(tuple(tensors), block_ids))
        with self._lock:
            start = self._ranges.allocate(total)
            if start is not None and not self._room_for(start + total):
                self._ranges.free(start, total)
                start = None
            if start is not None and self._memory is None:
                storage = torch.UntypedStorage._new_shared(self._ranges.capacity)
                self._memory = torch.empty(0, dtype=torch.uint8).set_(storage)
            memory = self._memory
        if start is None or memory is None:
            return ExportCopy(read_blocks(tuple(tensors), block_ids))
        outs = []
        offset = start
        for tensor, shape, size in zip(tensors, shapes, sizes, strict=True):
            nbytes = torch.Size(shape).numel() * tensor.element_size()
            outs.append(memory[offset : offset + nbytes].view(tensor.dtype).view(shape))
            offset += size
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                with self._lock:
                    self._ranges.free(start, total)

        try:
            checksum = self._copy_and_hash(tensors, block_ids, outs)
        except BaseException:
            release()
            raise
        return ExportCopy(tuple(outs), release, checksum)

    def _copy_and_hash(
        self, tensors: Sequence[torch.Tensor], block_ids: list[int], outs: list[torch.Tensor]
    ) -> int:
        """Gathers the blocks into `outs` in 1 MiB chunks on the copy threads, each chunk hashed
        as it is copied (`nori.kernels.copy_pieces`)."""
        sources: list[tuple[int, int]] = []
        ids = np.asarray(block_ids, dtype=np.int64)
        for tensor in tensors:
            itemsize = tensor.element_size()
            layer, half, block = (tensor.stride(dim) * itemsize for dim in range(3))
            block_bytes = block  # contiguous: a block's bytes are the block stride
            addresses = (
                tensor.data_ptr()
                + np.arange(tensor.shape[0], dtype=np.int64)[:, None, None] * layer
                + np.arange(2, dtype=np.int64)[None, :, None] * half
                + ids[None, None, :] * block
            ).ravel()
            sources.extend((address, block_bytes) for address in addresses.tolist())
        destinations = [(out.data_ptr(), out.nbytes) for out in outs]
        plan = copy_plan(sources, destinations, CHECKSUM_CHUNK_BYTES)
        digests = [0] * len(plan)

        def copy_share(first: int) -> None:
            copy_share_of_chunks(plan, first, COPY_THREADS, digests)

        if len(plan) > 1:
            list(self._copiers.map(copy_share, range(COPY_THREADS)))
        else:
            copy_share_of_chunks(plan, 0, 1, digests)
        hasher = TransferHasher()
        if plan:
            hasher.add_chunk_digests(digests, int(plan[-1][:, 2].sum()))
        return hasher.intdigest()
