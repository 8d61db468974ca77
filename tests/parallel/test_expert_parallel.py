"""Mixture-of-experts models across ranks on CPU (gloo, ranks as processes): with
`tensor_parallel_size=2, enable_expert_parallel=True` each rank holds half of the experts whole,
and Mixtral, Qwen2-MoE (shared expert, a dense layer) and Qwen3-MoE give the tokens of one rank
and transformers' logits to 1e-4; without expert parallelism (every expert sliced across the
ranks) Qwen2-MoE does too. An expert count the ranks do not split is refused before any rank
starts; a dense model ignores the flag, saying so. The flag itself reaches the engine from every
command that builds one, and `nori up` gives it to one pool only.

The checkpoints are transformers' own (`tests/engine/moe_checkpoints.py`); each test checks the
shard it ran on (experts per rank, expert ids shifted) so that a flag that silently did nothing
would fail here.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from nori.cli.engine_args import changed_engine_flags, engine_config_from_args, worker_args
from nori.cli.main import build_parser
from nori.engine.llm import LLM
from nori.models.init_checkpoint import init_checkpoint
from nori.models.moe import SparseMoeBlock
from nori.sampling.params import SamplingParams
from tests.engine.moe_checkpoints import MOE_ARCHITECTURES, VOCAB_SIZE, write_moe_checkpoint
from tests.engine.reference import HFGreedy, hf_greedy
from tests.engine.test_fidelity import assert_matches, make_prompts

NUM_EXPERTS = 8  # moe_checkpoints' count
# Batched, chunked (max_num_batched_tokens below the longest prompt) and cached prompts alike.
ENGINE = {"dtype": "float32", "num_kv_blocks": 256, "block_size": 8, "max_num_batched_tokens": 48}
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize(
    "command",
    [
        ["serve", "prefill"],
        ["serve", "decode"],
        ["serve", "decode", "--colocated"],
        ["generate", "--prompt", "hi"],
        ["bench", "offline"],
    ],
)
def test_the_flag_becomes_the_engines_setting(command: list[str]) -> None:
    args = build_parser().parse_args([*command, "-tp", "2", "--enable-expert-parallel"])
    config = engine_config_from_args(args)
    assert (config.tensor_parallel_size, config.enable_expert_parallel) == (2, True)
    assert not engine_config_from_args(build_parser().parse_args(command)).enable_expert_parallel


def test_up_gives_one_pool_expert_parallelism() -> None:
    """`nori up --prefill-args '-tp 2 --enable-expert-parallel'`: checked as worker flags, and
    the prefill workers only get them; everything else stays off for every worker."""
    pool_flags = "-tp 2 --enable-expert-parallel"
    args = build_parser().parse_args(["up", "--prefill-args", pool_flags])
    assert changed_engine_flags(args, args.engine_actions) == []
    prefill = worker_args(args.prefill_args, "--prefill-args")
    assert worker_args(args.decode_args, "--decode-args") == ()
    worker = engine_config_from_args(build_parser().parse_args(["serve", "prefill", *prefill]))
    assert worker.enable_expert_parallel and worker.tensor_parallel_size == 2
    everywhere = build_parser().parse_args(["up", "--enable-expert-parallel"])
    flags = changed_engine_flags(everywhere, everywhere.engine_actions)
    assert flags == ["--enable-expert-parallel"]


@pytest.fixture(scope="module", params=MOE_ARCHITECTURES)
def moe_checkpoint(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, list[list[int]], list[HFGreedy]]:
    folder = write_moe_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    prompts = make_prompts(VOCAB_SIZE, seed=0)
    # assert_matches generates test_fidelity's NEW_TOKENS (32), as GREEDY above.
    return folder, prompts, hf_greedy(folder, prompts, GREEDY.max_tokens or 0)


def rank_zero_moe_blocks(llm: LLM) -> list[SparseMoeBlock]:
    return list(llm.engine._runner.model.moe_blocks().values())


@pytest.mark.slow
def test_expert_parallel_matches_one_rank_and_transformers(
    moe_checkpoint: tuple[Path, list[list[int]], list[HFGreedy]],
) -> None:
    folder, prompts, expected = moe_checkpoint
    single = LLM(str(folder), **ENGINE)
    want = [o.outputs[0].token_ids for o in single.generate(prompts, GREEDY, use_tqdm=False)]
    with LLM(str(folder), tensor_parallel_size=2, enable_expert_parallel=True, **ENGINE) as split:
        outputs, _ = assert_matches(split, prompts, expected)
        # Rank 0 holds experts 0-3 whole (rank 1 the rest) and still routes over all 8.
        for block in rank_zero_moe_blocks(split):
            assert block.expert_start == 0
            assert block.experts.num_experts == NUM_EXPERTS // 2
            assert block.gate.weight.shape[0] == NUM_EXPERTS
            # Tokens went to experts on both ranks (else half of the dispatch went unchecked).
            counts = block.routed_tokens
            assert int(counts[:4].sum()) > 0 and int(counts[4:].sum()) > 0, counts.tolist()
    assert [o.outputs[0].token_ids for o in outputs] == want


@pytest.mark.slow
def test_sliced_experts_match_transformers(tmp_path: Path) -> None:
    """Tensor parallelism without expert parallelism: every expert (and the shared expert and
    the dense layer) has half of its intermediate features on each rank."""
    folder = write_moe_checkpoint(tmp_path, "qwen2_moe", seed=2)
    prompts = make_prompts(VOCAB_SIZE, seed=1)
    expected = hf_greedy(folder, prompts, GREEDY.max_tokens or 0)
    with LLM(str(folder), tensor_parallel_size=2, **ENGINE) as split:
        assert_matches(split, prompts, expected)
        blocks = rank_zero_moe_blocks(split)
        assert len(blocks) == 2  # of 3 layers: layer 1 is dense (mlp_only_layers)
        for block in blocks:
            assert block.experts.num_experts == NUM_EXPERTS
            assert block.experts.w2.shape[2] == 32 // 2  # moe_intermediate_size 32
            assert block.shared_expert is not None
            assert block.shared_expert.intermediate_size == 80 // 2


def test_an_expert_count_the_ranks_do_not_split_is_refused(tmp_path: Path) -> None:
    """6 experts over 4 ranks: named, before any rank process starts."""
    folder = write_moe_checkpoint(tmp_path, "mixtral", num_local_experts=6)
    with pytest.raises(
        ValueError, match=r"--tensor-parallel-size 4 must divide the model's experts"
    ):
        LLM(str(folder), tensor_parallel_size=4, enable_expert_parallel=True, **ENGINE)


def test_a_dense_model_ignores_the_flag_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    init_checkpoint(tmp_path, "tiny", seed=1)
    with caplog.at_level(logging.INFO, logger="nori.engine.model_runner"):
        llm = LLM(str(tmp_path), enable_expert_parallel=True, **ENGINE)
    assert "has no experts; ignored" in caplog.text
    assert llm.engine.expert_routing_counts() is None  # no mixture-of-experts block
