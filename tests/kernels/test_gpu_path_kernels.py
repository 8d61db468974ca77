"""The GPU path's kernels and aten calls per decoder layer, counted on CPU: every Triton kernel
the layer launches (under TRITON_INTERPRET=1, with the GPU's choices forced) plus its GEMMs, and
every aten call it makes, for one decode step of a tiny model with the Triton attention backend.
The count is of a layer past the first, which also makes the step's views of every layer."""

from __future__ import annotations

import importlib
import pkgutil
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

import nori.kernels as kernels_package
import nori.kernels._common as common
from nori.engine.config import EngineConfig
from nori.engine.engine import LLMEngine
from nori.engine.model_runner import ModelRunner
from nori.models.init_checkpoint import init_checkpoint
from nori.sampling.params import SamplingParams

# Issue 50's targets for the GPU path's decode step.
MAX_KERNELS_PER_LAYER = 12
MAX_ATEN_CALLS_PER_LAYER = 15


class _Counting(TorchDispatchMode):
    def __init__(self, counting: dict[str, bool], ops: Counter[str]) -> None:
        super().__init__()
        self.counting, self.ops = counting, ops

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if self.counting["on"]:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def decode_layer_counts(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Counter[str], Counter[str]]]:
    """(Triton launches, aten calls) of decoder layer 1 in one decode step of four sequences."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield _count_decode_layer(tmp_path_factory, monkeypatch)


def _count_decode_layer(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> tuple[Counter[str], Counter[str]]:
    counting = {"on": False}
    launches: Counter[str] = Counter()
    ops: Counter[str] = Counter()
    jit = common.jit

    def counting_jit(fn: Callable[..., Any]) -> Any:
        kernel = jit(fn)

        class Launcher:
            def __getitem__(self, grid: Any) -> Callable[..., Any]:
                def launch(*args: Any, **kwargs: Any) -> Any:
                    if counting["on"]:
                        launches[fn.__name__] += 1
                    with _disable_current_modes():  # the interpreter's own torch calls
                        return kernel[grid](*args, **kwargs)

                return launch

        return Launcher()

    for info in pkgutil.iter_modules(kernels_package.__path__):
        module = importlib.import_module(f"nori.kernels.{info.name}")
        if getattr(module, "jit", None) is jit:
            monkeypatch.setattr(module, "jit", counting_jit)
        if hasattr(module, "should_use_triton") and info.name in (
            "rms_norm",
            "rotary",
            "silu_and_mul",
        ):
            monkeypatch.setattr(module, "should_use_triton", lambda *_: True)

    model = init_checkpoint(tmp_path_factory.mktemp("gpu_path") / "tiny", "tiny")
    config = EngineConfig(
        model=str(model), num_kv_blocks=64, dtype="float32", attention_backend="triton"
    )
    runner = ModelRunner(config, model)
    engine = LLMEngine(config, runner=runner)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for index in range(4):
        engine.add_request(f"r{index}", [5 + index, 9, 33, 2], params)
    engine.step()  # the prompts
    layer = runner.model.get_submodule("model.layers.1")
    layer.register_forward_pre_hook(lambda *_: counting.update(on=True))
    layer.register_forward_hook(lambda *_: counting.update(on=False))
    with _Counting(counting, ops):
        outputs = engine.step()
    assert len(outputs) == 4 and all(len(o.new_token_ids) == 1 for o in outputs)
    return launches, ops


def test_a_decode_layer_launches_at_most_twelve_kernels(
    decode_layer_counts: tuple[Counter[str], Counter[str]],
) -> None:
    launches, ops = decode_layer_counts
    gemms = ops["linear"] + ops["mm"] + ops["addmm"]
    assert gemms == 4  # qkv, o, gate_up, down
    # Norms (2), rotary, the K/V store, decode attention (split and merge), SiLU·mul.
    assert set(launches) >= {"_rms_norm_kernel", "_rotary_kernel", "_silu_and_mul_kernel"}
    assert gemms + sum(launches.values()) <= MAX_KERNELS_PER_LAYER, (launches, ops)
    assert not any(name in ops for name in ("add", "mul", "rsqrt", "cat", "neg", "silu")), ops


def test_a_decode_layer_makes_at_most_fifteen_aten_calls(
    decode_layer_counts: tuple[Counter[str], Counter[str]],
) -> None:
    """Views, slices and allocations count too: the cache views and the metadata's row slices
    are made once per step, not per layer."""
    _, ops = decode_layer_counts
    listing = ", ".join(f"{name} {count}" for name, count in ops.most_common())
    assert sum(ops.values()) <= MAX_ATEN_CALLS_PER_LAYER, (
        f"{sum(ops.values())} aten calls in a decode layer, at most "
        f"{MAX_ATEN_CALLS_PER_LAYER} allowed: {listing}"
    )
    assert not any(name in ops for name in ("select", "slice", "unbind")), listing
