"""The KV pool sized from a profiled memory budget (nori.engine.memory_profile): the pool
formula, its error, the log lines, the profile's arithmetic over torch.cuda's counters, the
block count it gives, and the dummy step that the profile runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nori.engine import memory_profile
from nori.engine.config import EngineConfig
from nori.engine.dummy_step import (
    DummyStep,
    dummy_decode_shape,
    dummy_step_shape,
    run_dummy_step,
)
from nori.engine.kv_cache import KVCache, bytes_per_block, num_blocks_in_budget
from nori.engine.memory_profile import (
    GIB,
    MemoryProfile,
    budget_summary,
    decode_graph_pool_bytes,
    kv_pool_bytes,
    pool_summary,
    profile_memory,
)
from nori.kernels.cpu_build import cpu_kernels
from nori.models.init_checkpoint import init_checkpoint
from nori.models.loader import load_model
from nori.models.presets import PRESETS
from nori.sampling.sampler import Sampler

MIB = 2**20
PROFILE = MemoryProfile(
    total=80 * GIB,
    weights=16 * GIB,
    peak_activations=2 * GIB,
    non_torch=GIB,
    graph_pool=512 * MIB,
)


def test_pool_is_total_times_utilization_less_everything_else() -> None:
    # 80 × 0.9 = 72 GiB; 72 − 16 − 2 − 1 − 0.5 = 52.5 GiB.
    assert kv_pool_bytes(PROFILE, 0.9) == 52 * GIB + 512 * MIB
    assert kv_pool_bytes(PROFILE, 1.0) == 60 * GIB + 512 * MIB


def test_pool_floors_a_fractional_share_of_total() -> None:
    profile = MemoryProfile(total=1001, weights=100, peak_activations=0, non_torch=0, graph_pool=0)
    assert kv_pool_bytes(profile, 0.5) == 400  # int(500.5) − 100


def test_nothing_left_names_the_flag_and_the_numbers() -> None:
    # 80 × 0.2 = 16 GiB: the weights alone take it all.
    with pytest.raises(ValueError, match=r"--gpu-memory-utilization 0\.2") as error:
        kv_pool_bytes(PROFILE, 0.2)
    message = str(error.value)
    for part in ("80.00 GiB", "16.00 GiB", "2.00 GiB", "1.00 GiB", "0.50 GiB", "-3.50 GiB left"):
        assert part in message


def test_budget_summary_splits_the_share() -> None:
    line = budget_summary(PROFILE, 0.9)
    assert line.startswith("GPU memory 80.00 GiB × 0.9 = 72.00 GiB: weights 16.00 GiB")
    assert line.endswith("graph pool 0.50 GiB, KV pool 52.50 GiB")


def test_pool_summary_gives_tokens_and_concurrency() -> None:
    assert pool_summary(1000, 16, 4096) == (
        "KV pool: 1000 blocks = 16000 tokens; max concurrency at max_model_len 4096: "
        "16000/4096 = 3.91x"
    )


class _FakeCuda:
    """torch.cuda's counters as a script: 10 GiB allocated before the step, a 13 GiB peak
    during it, 20 of 80 GiB used on the device of which torch reserves 14."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name, result in {
            "synchronize": None,
            "reset_peak_memory_stats": None,
            "memory_allocated": 10 * GIB,
            "max_memory_allocated": 13 * GIB,
            "mem_get_info": (60 * GIB, 80 * GIB),
            "memory_reserved": 14 * GIB,
        }.items():
            monkeypatch.setattr(torch.cuda, name, self._record(name, result))

    def _record(self, name: str, result: object) -> object:
        def call(device: torch.device | None = None) -> object:
            assert device == torch.device("cuda:0")
            self.calls.append(name)
            return result

        return call


def test_profile_measures_the_step_between_two_synchronizations(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cuda = _FakeCuda()
    cuda.install(monkeypatch)
    profile = profile_memory(
        lambda: cuda.calls.append("step"), torch.device("cuda:0"), 9 * GIB, 256 * MIB
    )
    assert profile == MemoryProfile(
        total=80 * GIB,
        weights=9 * GIB,
        peak_activations=3 * GIB,  # 13 − 10: a scratch GiB before the step is not counted
        non_torch=6 * GIB,  # 80 − 60 used, less 14 reserved
        graph_pool=256 * MIB,
    )
    assert cuda.calls == [
        "synchronize",
        "reset_peak_memory_stats",
        "memory_allocated",
        "step",
        "synchronize",
        "max_memory_allocated",
        "mem_get_info",
        "memory_reserved",
    ]


def test_profile_module_imports_without_cuda() -> None:
    assert memory_profile.MemoryProfile is MemoryProfile


def _budget_inputs() -> tuple[EngineConfig, torch.dtype]:
    return EngineConfig(block_size=16, gpu_memory_utilization=0.9), torch.float16


def test_blocks_on_cuda_come_from_the_profiled_pool() -> None:
    model = PRESETS["tiny"]
    config, dtype = _budget_inputs()
    cuda = torch.device("cuda")  # a profile given: no torch.cuda call is made
    per_block = bytes_per_block(model, 16, dtype)
    expected = kv_pool_bytes(PROFILE, 0.9) // per_block
    assert num_blocks_in_budget(config, model, dtype, cuda, profile=PROFILE) == expected
    # A draft model's share per block shrinks the count.
    with_draft = num_blocks_in_budget(config, model, dtype, cuda, per_block, PROFILE)
    assert with_draft == kv_pool_bytes(PROFILE, 0.9) // (2 * per_block)


def test_blocks_num_kv_blocks_wins_and_cpu_ignores_the_profile() -> None:
    model = PRESETS["tiny"]
    config, dtype = _budget_inputs()
    fixed = EngineConfig(num_kv_blocks=7)
    assert num_blocks_in_budget(fixed, model, dtype, torch.device("cuda"), 0, PROFILE) == 7
    cpu = torch.device("cpu")
    assert num_blocks_in_budget(config, model, dtype, cpu, 0, PROFILE) == (
        num_blocks_in_budget(config, model, dtype, cpu)
    )


def test_blocks_with_too_small_a_profile_raise() -> None:
    model = PRESETS["tiny"]
    config = EngineConfig(gpu_memory_utilization=0.2)
    with pytest.raises(ValueError, match="--gpu-memory-utilization"):
        num_blocks_in_budget(config, model, torch.float16, torch.device("cuda"), profile=PROFILE)


@pytest.mark.parametrize(
    ("tokens", "seqs", "max_len", "spec", "expected"),
    [
        (2048, 256, 4096, 0, DummyStep((2048,), 256)),  # one prompt chunk
        (2048, 256, 512, 0, DummyStep((512,) * 4, 256)),  # prompts capped at max_model_len
        (1000, 256, 300, 0, DummyStep((300, 300, 300, 100), 256)),
        (2048, 2, 512, 0, DummyStep((512, 512), 2)),  # no more than max_num_seqs prompts hold
        (64, 256, 4096, 0, DummyStep((64,), 64)),  # at most one logits row per token
        (2048, 256, 4096, 3, DummyStep((2048,), 1024)),  # verification rows
    ],
)
def test_dummy_step_shape(
    tokens: int, seqs: int, max_len: int, spec: int, expected: DummyStep
) -> None:
    assert dummy_step_shape(tokens, seqs, max_len, spec) == expected


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_dummy_step_runs_the_model_and_sampler_over_scratch_blocks(
    tmp_path: Path, backend: str
) -> None:
    if backend == "cpu" and cpu_kernels() is None:
        pytest.skip("no C++ CPU kernels here")
    folder = init_checkpoint(tmp_path / "tiny", "tiny", write_weights=False)
    model, config = load_model(folder, torch.float32, "cpu", load_format="dummy")
    step = dummy_step_shape(70, 8, 32)
    assert step == DummyStep((32, 32, 6), 8)
    cache = KVCache.allocate(config, step.num_blocks(8), 8, torch.float32, torch.device("cpu"))
    run_dummy_step(model, step, cache, backend, Sampler())
    # Every prompt wrote the same scratch blocks: all of them hold keys now.
    assert cache.data.abs().sum(dim=(0, 1, 3, 4, 5)).gt(0).all()


def test_decode_graph_pool_is_the_largest_graphs_peak_and_every_output() -> None:
    # Outputs of 1 + 2 + 4 + 8 rows of 8 KiB each.
    assert decode_graph_pool_bytes(100 * MIB, (1, 2, 4, 8), 8192) == 100 * MIB + 15 * 8192


def test_dummy_decode_shape_reads_one_scratch_block_at_full_context() -> None:
    step = dummy_decode_shape(16, 4096)
    assert (step.num_tokens, step.num_logits_rows, max(step.seq_lens)) == (16, 0, 4096)
    assert (step.num_blocks(16), step.table_width(16)) == (1, 256)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_dummy_decode_runs_the_decode_kernels(tmp_path: Path, backend: str) -> None:
    if backend == "cpu" and cpu_kernels() is None:
        pytest.skip("no C++ CPU kernels here")
    folder = init_checkpoint(tmp_path / "tiny", "tiny", write_weights=False)
    model, config = load_model(folder, torch.float32, "cpu", load_format="dummy")
    step = dummy_decode_shape(4, 40)
    cache = KVCache.allocate(config, step.num_blocks(8), 8, torch.float32, torch.device("cpu"))
    run_dummy_step(model, step, cache, backend, Sampler())
    # Position 39 of every row lands in slot 7 of the one block.
    assert cache.data[:, :, 0, 7].abs().sum() > 0
    assert cache.data[:, :, 0, :7].abs().sum() == 0


def test_a_cuda_pool_without_a_profile_is_refused() -> None:
    config, dtype = _budget_inputs()
    with pytest.raises(ValueError, match="memory profile"):
        num_blocks_in_budget(config, PRESETS["tiny"], dtype, torch.device("cuda"))
