"""Prompt logprobs (SamplingParams.prompt_logprobs) equal transformers' log_softmax of its logits.

Each prompt token i > 0 gets log p(token i | tokens < i), its rank, and the requested number of
most likely alternatives; token 0 gets None, as in vLLM. Checked on tiny random Llama and Qwen3
checkpoints in float32, batched, through chunked prefill, after the prompt's prefix is in the
prefix cache (which such a request must not read), and under preemption.
"""

from __future__ import annotations

import json
import random
import uuid
from pathlib import Path

import pytest
import torch

from nori.engine.config import EngineConfig
from nori.engine.engine import LLMEngine
from nori.engine.llm import LLM
from nori.engine.outputs import StepOutput
from nori.models.init_checkpoint import init_checkpoint
from nori.sampling.params import SamplingParams

ATOL = 1e-4
TOP = 3
LENGTHS = [1, 2, 7, 16, 17, 40, 90]


@pytest.fixture(scope="module", params=["tiny", "tiny-qwen3"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp(request.param)
    init_checkpoint(folder, request.param, seed=3)
    return folder


@pytest.fixture(scope="module")
def prompts(checkpoint: Path) -> list[list[int]]:
    vocab_size = _vocab_size(checkpoint)
    rng = random.Random(5)
    prefix = [rng.randrange(3, vocab_size) for _ in range(33)]
    randoms = [[rng.randrange(3, vocab_size) for _ in range(n)] for n in LENGTHS]
    return [*randoms, [*prefix, 5, 6, 7], prefix]


@pytest.fixture(scope="module")
def reference(checkpoint: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Per prompt, transformers' [len, vocab] log_softmax (row i scores token i + 1)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return [
            torch.log_softmax(model(torch.tensor([p])).logits[0].float(), dim=-1) for p in prompts
        ]


def _vocab_size(checkpoint: Path) -> int:
    return int(json.loads((checkpoint / "config.json").read_text())["vocab_size"])


def assert_prompt_logprobs(output: StepOutput, expected: torch.Tensor) -> None:
    prompt = output.prompt_token_ids
    entries = output.prompt_logprobs
    assert entries is not None and len(entries) == len(prompt)
    assert entries[0] is None
    for i, entry in enumerate(entries[1:], start=1):
        assert entry is not None
        row = expected[i - 1]
        assert entry.token_id == prompt[i]
        assert entry.logprob == pytest.approx(row[prompt[i]].item(), abs=ATOL)
        assert entry.rank == int((row > row[prompt[i]]).sum()) + 1
        top = row.topk(TOP)
        assert [token for token, _ in entry.top] == top.indices.tolist()
        torch.testing.assert_close(
            torch.tensor([value for _, value in entry.top]), top.values, atol=ATOL, rtol=0
        )


def make_engine(checkpoint: Path, **options: object) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(checkpoint), dtype="float32", **options))  # type: ignore[arg-type]


def run(
    engine: LLMEngine, prompts: list[list[int]], max_tokens: int = 1, top: int | None = TOP
) -> list[StepOutput]:
    """Each prompt to its end in one batch; the final outputs in the prompts' order."""
    params = SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, prompt_logprobs=top
    )
    ids = [f"{uuid.uuid4().hex[:8]}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, prompt, params)
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    engine.kv_cache.check_invariants()
    return [finals[request_id] for request_id in ids]


def test_batched_prompt_logprobs_match_transformers(
    checkpoint: Path, prompts: list[list[int]], reference: list[torch.Tensor]
) -> None:
    engine = make_engine(checkpoint, num_kv_blocks=256, block_size=8)
    for output, expected in zip(run(engine, prompts, max_tokens=4), reference, strict=True):
        assert_prompt_logprobs(output, expected)
        assert len(output.token_ids) == 4


def test_chunked_prefill_prompt_logprobs_match_transformers(
    checkpoint: Path, prompts: list[list[int]], reference: list[torch.Tensor]
) -> None:
    engine = make_engine(
        checkpoint, num_kv_blocks=256, block_size=4, max_num_batched_tokens=12, max_num_seqs=3
    )
    for output, expected in zip(run(engine, prompts), reference, strict=True):
        assert_prompt_logprobs(output, expected)


def test_prompt_logprobs_skip_the_prefix_cache(
    checkpoint: Path, prompts: list[list[int]], reference: list[torch.Tensor]
) -> None:
    engine = make_engine(checkpoint, num_kv_blocks=256, block_size=8)
    warm = run(engine, prompts[-2:-1], top=None)  # the shared prefix's blocks are now cached
    assert warm[0].prompt_logprobs is None
    for output, expected in zip(run(engine, prompts[-2:]), reference[-2:], strict=True):
        assert output.num_cached_tokens == 0
        assert_prompt_logprobs(output, expected)
    # A request without prompt logprobs still hits the cache.
    assert run(engine, prompts[-1:], top=None)[0].num_cached_tokens > 0


def test_prompt_logprobs_survive_preemption(
    checkpoint: Path, prompts: list[list[int]], reference: list[torch.Tensor]
) -> None:
    engine = make_engine(
        checkpoint,
        block_size=4,
        num_kv_blocks=40,
        max_num_batched_tokens=16,
        enable_prefix_caching=False,
    )
    outputs = run(engine, prompts, max_tokens=24)
    assert engine.load().num_preemptions > 0
    for output, expected in zip(outputs, reference, strict=True):
        assert_prompt_logprobs(output, expected)


def test_llm_generate_reports_them_as_vllm_does(
    checkpoint: Path, prompts: list[list[int]], reference: list[torch.Tensor]
) -> None:
    """vLLM's layout: per prompt token a dict, the token's own entry first, then the top ones."""
    llm = LLM(str(checkpoint), dtype="float32", num_kv_blocks=64, block_size=8)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=TOP)
    prompt, expected = prompts[3], reference[3]
    [output] = llm.generate([prompt], params, use_tqdm=False)
    assert output.prompt_logprobs is not None and output.prompt_logprobs[0] is None
    for i, entry in enumerate(output.prompt_logprobs[1:], start=1):
        assert entry is not None
        row = expected[i - 1]
        assert next(iter(entry)) == prompt[i]
        assert entry[prompt[i]].logprob == pytest.approx(row[prompt[i]].item(), abs=ATOL)
        for rank, token_id in enumerate(row.topk(TOP).indices.tolist(), start=1):
            assert entry[token_id].rank == rank
            assert entry[token_id].logprob == pytest.approx(row[token_id].item(), abs=ATOL)


def test_only_the_first_delta_carries_them_on_the_wire(checkpoint: Path) -> None:
    from nori.rpc.convert import prompt_logprobs_from_delta
    from nori.worker.servicer_base import delta_from_output

    engine = make_engine(checkpoint, num_kv_blocks=64, block_size=8)
    engine.add_request("r", [5, 6, 7, 8], SamplingParams(max_tokens=3, prompt_logprobs=0))
    deltas = []
    while engine.has_unfinished_requests():
        deltas.extend(delta_from_output(output) for output in engine.step())
    received = [prompt_logprobs_from_delta(delta) for delta in deltas]
    assert received[1:] == [None, None]
    first = received[0]
    assert first is not None and first[0] is None
    assert [entry.token_id for entry in first[1:] if entry is not None] == [6, 7, 8]
    assert all(entry.top == () for entry in first[1:] if entry is not None)
