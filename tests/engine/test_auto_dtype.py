"""`--dtype auto`: on CPU bfloat16 only for a half-type checkpoint on a CPU with bf16
instructions, else float32; on GPU the checkpoint's half type, else bfloat16."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from nori.engine import device as device_module
from nori.engine.device import resolve_dtype
from nori.models.presets import get_preset

CPU = torch.device("cpu")


@pytest.mark.parametrize("has_bf16", [True, False])
@pytest.mark.parametrize("stored", ["bfloat16", "float16", "float32", None])
def test_auto_follows_the_checkpoint_and_the_cpu(
    monkeypatch: pytest.MonkeyPatch, has_bf16: bool, stored: str | None
) -> None:
    monkeypatch.setattr(device_module, "cpu_has_bf16", lambda: has_bf16)
    config = replace(get_preset("tiny"), torch_dtype=stored)
    half = stored in ("bfloat16", "float16")
    expected = torch.bfloat16 if half and has_bf16 else torch.float32
    assert resolve_dtype("auto", CPU, config) is expected
    # An explicit dtype is taken as given.
    assert resolve_dtype("float32", CPU, config) is torch.float32
    assert resolve_dtype("bfloat16", CPU, config) is torch.bfloat16


def test_the_cpu_flags_decide_bf16() -> None:
    with open("/proc/cpuinfo") as cpuinfo:
        flags = cpuinfo.read().split()
    assert device_module.cpu_has_bf16() == ("avx512_bf16" in flags or "amx_bf16" in flags)
