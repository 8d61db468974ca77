"""Writes that survive a crash or a power loss: a file replaced whole (`write_atomically`) and
an append-only log whose records count once fsync'd (`AppendLog`)."""

from __future__ import annotations

import asyncio
import os
import secrets
from pathlib import Path


def write_atomically(path: Path, data: bytes) -> None:
    """`path` holds `data` whole or is as it was: never a torn file, even on power loss."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    with tmp.open("wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class AppendLog:
    """An append-only JSON-lines log of results; `append` returns once the record is fsync'd
    (records arriving during a write share the next fsync)."""

    def __init__(self, path: Path) -> None:
        new = not path.exists()
        self._file = path.open("ab")
        if new:
            fsync_dir(path.parent)
        elif self._file.tell() > 0:
            # A torn last record (a writer killed mid-write): end it, so the next starts a line.
            with path.open("rb") as log:
                log.seek(-1, os.SEEK_END)
                if log.read(1) != b"\n":
                    self._file.write(b"\n")
        self._pending: list[tuple[bytes, asyncio.Future[None]]] = []
        self._writer: asyncio.Task[None] | None = None

    async def append(self, record: bytes) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((record, future))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write_pending())
        await future

    async def _write_pending(self) -> None:
        while self._pending:
            group, self._pending = self._pending, []
            data = b"".join(record + b"\n" for record, _ in group)
            try:
                await asyncio.to_thread(self._write, data)
            except Exception as error:
                for _, future in group:
                    future.set_exception(error)
                continue
            for _, future in group:
                if not future.done():
                    future.set_result(None)

    def _write(self, data: bytes) -> None:
        self._file.write(data)
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()
