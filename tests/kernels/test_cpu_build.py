"""The C++ kernels' build: its units include every kernel file once; it goes under
$TORCH_EXTENSIONS_DIR when set; a lock left by a build killed part-way is cleared (it would make
every later start wait for ever), also when it went stale while a start waited on it; a lock of
a build in progress is not."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import pytest

from nori.kernels.cpu_build import (
    _UNITS,
    STALE_BUILD_LOCK_S,
    build_root,
    clear_stale_build_lock,
    wait_for_build_lock,
    write_units,
)


def _lock(build_dir: Path, age_s: float) -> Path:
    lock = build_dir / "lock"
    lock.write_text("")
    stamp = time.time() - age_s
    os.utime(lock, (stamp, stamp))
    return lock


def test_a_stale_lock_is_removed_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    lock = _lock(tmp_path, STALE_BUILD_LOCK_S + 60)
    with caplog.at_level(logging.WARNING, logger="nori.kernels.cpu_build"):
        assert clear_stale_build_lock(tmp_path)
    assert not lock.exists()
    assert "stale lock" in caplog.text and str(lock) in caplog.text


def test_a_build_in_progress_keeps_its_lock(tmp_path: Path) -> None:
    lock = _lock(tmp_path, 30)
    assert not clear_stale_build_lock(tmp_path)
    assert lock.exists()
    # The same lock is stale once the clock passes the limit.
    assert clear_stale_build_lock(tmp_path, now=time.time() + STALE_BUILD_LOCK_S)
    assert not lock.exists()


def test_a_start_waits_for_a_build_in_progress(tmp_path: Path) -> None:
    lock = _lock(tmp_path, 1)
    release = threading.Timer(0.3, lock.unlink)
    release.start()
    started = time.monotonic()
    wait_for_build_lock(tmp_path, max_age_s=60, poll_s=0.05)
    assert 0.25 < time.monotonic() - started < 5
    assert not lock.exists()


def test_a_lock_that_goes_stale_while_a_start_waits_is_removed(tmp_path: Path) -> None:
    """The build holding it was killed just before this start: the lock is young at first."""
    lock = _lock(tmp_path, 0)
    started = time.monotonic()
    wait_for_build_lock(tmp_path, max_age_s=0.5, poll_s=0.05)
    assert 0.4 < time.monotonic() - started < 5
    assert not lock.exists()


def test_no_lock_is_nothing_to_do(tmp_path: Path) -> None:
    assert not clear_stale_build_lock(tmp_path)


def test_builds_go_under_torch_extensions_dir_when_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert build_root("/default") == tmp_path
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    assert build_root("/default") == Path("/default")


def test_the_units_include_every_kernel_file_once(tmp_path: Path) -> None:
    folder = Path(__file__).resolve().parents[2] / "shared" / "kernels"
    included = [source for unit in _UNITS for source in unit]
    assert sorted(included) == sorted(path.name for path in folder.glob("*.cpp"))
    units = write_units(folder, tmp_path)
    assert [unit.name for unit in units] == [f"unit_{n}.cpp" for n in range(len(_UNITS))]
    assert units[1].read_text().splitlines() == [f'#include "{folder / s}"' for s in _UNITS[1]]
    # Unchanged units are not rewritten: ninja would rebuild them.
    stamp = units[0].stat().st_mtime_ns
    time.sleep(0.01)
    write_units(folder, tmp_path)
    assert units[0].stat().st_mtime_ns == stamp
