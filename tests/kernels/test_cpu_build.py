"""The C++ kernels' build: plain C++ (no torch headers, no libtorch) linked against torch's own
OpenMP runtime; it goes under $TORCH_EXTENSIONS_DIR when set, keyed by a tag of its sources and
folder; it lands by an atomic rename, so concurrent builds both succeed and what a killed build
left behind never blocks a start; without a compiler (or with NORI_CPU_KERNELS=0) the PyTorch
references run."""

from __future__ import annotations

import ctypes
import logging
import re
import subprocess
import threading
from pathlib import Path

import pytest
import torch

from nori.kernels import cpu_build
from nori.kernels.cpu_build import build_library, build_root, build_tag, cpu_kernels

KERNELS = Path(cpu_build.__file__).resolve().parent
needs_kernels = pytest.mark.skipif(cpu_kernels() is None, reason="the C++ kernels need g++")


def _tiny_kernels(folder: Path, body: str = "return 7;") -> Path:
    """A kernel folder of two small files, quick to build."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / cpu_build.SEPARATE).write_text(f'extern "C" int nori_seven() {{ {body} }}\n')
    (folder / "other_cpu.cpp").write_text('extern "C" int nori_eight() { return 8; }\n')
    return folder


def test_builds_go_under_torch_extensions_dir_when_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert build_root() == tmp_path
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    assert build_root() == Path.home() / ".cache" / "torch_extensions"


def test_the_tag_follows_the_sources_and_their_folder(tmp_path: Path) -> None:
    first = build_tag(_tiny_kernels(tmp_path / "a"))
    assert build_tag(tmp_path / "a") == first
    assert build_tag(_tiny_kernels(tmp_path / "b")) != first  # another checkout
    _tiny_kernels(tmp_path / "a", "return 6;")
    assert build_tag(tmp_path / "a") != first


def test_a_build_lands_once_and_loads(tmp_path: Path) -> None:
    folder = _tiny_kernels(tmp_path / "src")
    target = build_library(folder, tmp_path / "cache")
    assert target.name == f"nori_cpu_kernels_{build_tag(folder)}.so"
    assert ctypes.CDLL(str(target)).nori_seven() == 7
    assert ctypes.CDLL(str(target)).nori_eight() == 8
    stamp = target.stat().st_mtime_ns
    assert build_library(folder, tmp_path / "cache") == target  # built already: loaded as is
    assert target.stat().st_mtime_ns == stamp
    assert [path.name for path in (tmp_path / "cache").iterdir()] == [target.name]


def test_what_a_killed_build_left_never_blocks(tmp_path: Path) -> None:
    """A build killed part-way leaves its private folder with partial files; the next start
    builds beside it and loads its own library."""
    folder, cache = _tiny_kernels(tmp_path / "src"), tmp_path / "cache"
    leftover = cache / f".nori_cpu_kernels_{build_tag(folder)}_killed"
    leftover.mkdir(parents=True)
    (leftover / "lib.so").write_bytes(b"\x7fELF half a library")
    (leftover / "0.o").write_bytes(b"")
    target = build_library(folder, cache)
    assert ctypes.CDLL(str(target)).nori_seven() == 7


def test_concurrent_builds_both_succeed(tmp_path: Path) -> None:
    folder, cache = _tiny_kernels(tmp_path / "src"), tmp_path / "cache"
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(build_library(folder, cache)))
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 2 and results[0] == results[1]
    assert ctypes.CDLL(str(results[0])).nori_seven() == 7
    assert [path.name for path in cache.iterdir()] == [results[0].name]  # no temporaries left


def test_a_failed_build_says_why_and_leaves_nothing(tmp_path: Path) -> None:
    folder, cache = _tiny_kernels(tmp_path / "src", "return missing;"), tmp_path / "cache"
    with pytest.raises(RuntimeError, match="missing"):
        build_library(folder, cache)
    assert list(cache.iterdir()) == []


def test_no_compiler_or_disabled_means_the_references(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_build.shutil, "which", lambda name: None)
    with caplog.at_level(logging.WARNING, logger="nori.kernels.cpu_build"):
        assert cpu_kernels.__wrapped__() is None
    assert "could not be built (no C++ compiler" in caplog.text
    monkeypatch.setenv("NORI_CPU_KERNELS", "0")
    assert cpu_kernels.__wrapped__() is None


def test_the_sources_use_no_torch_headers() -> None:
    for source in [*KERNELS.glob("*.cpp"), *KERNELS.glob("*.h")]:
        includes = re.findall(r'#include [<"]([^>"]+)[>"]', source.read_text())
        assert not [i for i in includes if re.match(r"(torch|ATen|c10|pybind11|Python)", i)]


@needs_kernels
def test_the_library_links_torch_openmp_runtime_and_not_libtorch() -> None:
    library = next(build_root().glob(f"nori_cpu_kernels_{build_tag(KERNELS)}.so"))
    linked = subprocess.run(["ldd", str(library)], capture_output=True, text=True).stdout
    assert not re.search(r"libtorch|libc10|libpython", linked), linked
    if (cpu_build.TORCH_LIB / "libgomp.so.1").exists():
        assert f"libgomp.so.1 => {cpu_build.TORCH_LIB}/libgomp.so.1" in linked
    # Loading it changed no floating-point mode of torch's (flush-to-zero would zero this).
    assert float(torch.tensor([2e-39]) / 2) != 0.0


def _record_team_size(kernels: cpu_build.CpuKernels, seen: list[int]) -> None:
    seen.append(kernels._team_size(torch.get_num_threads()))


@needs_kernels
def test_kernels_use_torch_threads_from_any_thread() -> None:
    """The kernels run on as many threads as torch.get_num_threads() in the calling thread, in
    torch's own OpenMP runtime: torch.set_num_threads sets its team size, also in a thread
    started afterwards (torch sizes a new thread's team from the last set_num_threads)."""
    kernels, before = cpu_kernels(), torch.get_num_threads()
    assert kernels is not None
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert kernels._omp_max_threads() == threads  # the runtime torch set
            assert kernels._team_size(torch.get_num_threads()) == threads
            seen: list[int] = []
            worker = threading.Thread(target=_record_team_size, args=(kernels, seen))
            worker.start()
            worker.join()
            assert seen == [threads]
    finally:
        torch.set_num_threads(before)


def test_each_signature_matches_its_c_function() -> None:
    """NORI_SIGNATURE's letters (what ctypes passes) against the C parameters beside it: P for a
    pointer or an int64_t, F for a float; no other parameter type would travel right."""
    text = "".join(path.read_text() for path in KERNELS.glob("*.cpp"))
    pattern = r'NORI_SIGNATURE\((\w+), "([PF]*)"\);\s*extern "C" int nori_(\w+)\(([^)]*)\)'
    found = re.findall(pattern, text)
    assert len(found) == text.count('extern "C" int nori_') > 10
    for name, letters, function, parameters in found:
        types = [" ".join(p.split()[:-1]) for p in parameters.split(",") if p.strip()]
        assert all(t in ("int64_t", "float") or t.endswith("*") for t in types), (name, types)
        assert name == function and "".join("F" if t == "float" else "P" for t in types) == letters
