"""Builds the C++ CPU kernels on first use (torch.utils.cpp_extension), once per machine.

Files in one translation unit (`_UNITS`) must not define the same internal names. Needs a C++
compiler and ninja; where it cannot be built, the PyTorch references run (one warning).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from nori.settings import Environment

logger = logging.getLogger(__name__)

_UNITS = (
    (
        "cpu_module.cpp",
        "argmax_cpu.cpp",
        "bf16_gemv_cpu.cpp",
        "copy_pieces_cpu.cpp",
        "decode_attention_cpu.cpp",
        "fused_moe_cpu.cpp",
        "rms_norm_cpu.cpp",
        "rotary_cpu.cpp",
        "row_scale_cpu.cpp",
        "silu_and_mul_cpu.cpp",
        "store_kv_cpu.cpp",
    ),
    ("int8_gemv_cpu.cpp", "store_kv_quant_cpu.cpp"),
)
_SOURCES = tuple(source for unit in _UNITS for source in unit)
# -march=native: built where it runs. -ffast-math vectorises the float sums (the kernels promise
# float32 rounding, not bit-exactness; they never produce infinities).
_CFLAGS = [
    "-O3",
    "-fopenmp",
    "-march=native",
    "-ffast-math",
]


def _build_tag(folder: Path) -> str:
    """Tells builds apart in a shared cache: the machine, the flags, the sources and their
    folder, so checkouts never load each other's module nor take turns rebuilding one."""
    try:
        flags = next(
            line
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        )
    except (OSError, StopIteration):
        flags = "unknown"
    digest = hashlib.sha256(flags.encode())
    digest.update(" ".join(_CFLAGS).encode())
    digest.update(str(folder).encode())
    for source in _SOURCES:
        digest.update((folder / source).read_bytes())
    return digest.hexdigest()[:10]


def write_units(folder: Path, build_dir: Path) -> list[Path]:
    """The translation units `unit_N.cpp` in `build_dir`, each including its kernel files by
    absolute path (rewritten only when changed, so ninja does not rebuild)."""
    units = []
    for number, sources in enumerate(_UNITS):
        unit = build_dir / f"unit_{number}.cpp"
        text = "".join(f'#include "{folder / source}"\n' for source in sources)
        if not unit.exists() or unit.read_text() != text:
            unit.write_text(text)
        units.append(unit)
    return units


def build_root(default_root: str) -> Path:
    """$TORCH_EXTENSIONS_DIR (torch's `get_default_build_root` ignores it), else torch's default."""
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or default_root)


# A lock this old was left by a killed build (torch would wait on it for ever).
STALE_BUILD_LOCK_S = 5 * 60


def clear_stale_build_lock(
    build_dir: Path, max_age_s: float = STALE_BUILD_LOCK_S, now: float | None = None
) -> bool:
    """Removes `build_dir/lock` when older than `max_age_s`; returns whether it did (a younger
    one is a build in progress)."""
    lock = build_dir / "lock"
    try:
        age_s = (time.time() if now is None else now) - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age_s < max_age_s:
        return False
    logger.warning(
        "removing a stale lock of the C++ kernels' build (%s, %.0f s old): a build that was "
        "killed part-way left it",
        lock,
        age_s,
    )
    lock.unlink(missing_ok=True)
    return True


def wait_for_build_lock(
    build_dir: Path, max_age_s: float = STALE_BUILD_LOCK_S, poll_s: float = 0.5
) -> None:
    """Returns once `build_dir` holds no lock: a build in progress released it, or it grew
    stale (its build was killed, even after this wait began) and was removed."""
    while (build_dir / "lock").exists() and not clear_stale_build_lock(build_dir, max_age_s):
        time.sleep(poll_s)


# The dtypes the per-layer C++ kernels serve; others take the PyTorch references.
CPU_KERNEL_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)


@functools.cache
def cpu_kernels() -> Any | None:
    """The compiled module; None where it cannot be built (logged once) or NORI_CPU_KERNELS=0."""
    if not Environment.read().cpu_kernels:
        return None
    try:
        from torch.utils.cpp_extension import get_default_build_root, load

        folder = Path(__file__).resolve().parent
        name = f"nori_cpu_kernels_{_build_tag(folder)}"
        build_dir = build_root(get_default_build_root()) / name
        build_dir.mkdir(parents=True, exist_ok=True)
        wait_for_build_lock(build_dir)
        # Link the OpenMP runtime torch has loaded: one thread pool, sized by set_num_threads.
        torch_lib = Path(torch.__file__).resolve().parent / "lib"
        return load(
            name=name,
            sources=[str(path) for path in write_units(folder, build_dir)],
            extra_cflags=_CFLAGS,
            extra_ldflags=[f"-L{torch_lib}", "-lgomp", f"-Wl,-rpath,{torch_lib}"],
            build_directory=str(build_dir),
            verbose=False,
        )
    except Exception as error:  # no compiler, no ninja, an unsupported platform, ...
        logger.warning(
            "the C++ CPU kernels could not be built (%s); using the PyTorch references",
            str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__,
        )
        return None
