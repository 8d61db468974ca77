"""Overlapped steps: a plain step's tokens stay on the device while the next step is launched,
and the outputs are the tokens of an engine that resolves every step at once.

The reference is the same engine with `LaunchedStep.defers` answering no (each step's tokens copied out
before the next is scheduled, as before the overlap). The load mixes greedy and seeded
sampling, stop tokens and stop strings, max_tokens and min_tokens, penalties and logprobs
(rows that are never deferred) beside plain ones, prompt logprobs, chunked prefill, a pool
small enough to preempt, and an abort mid-decode.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from nori.engine.config import EngineConfig
from nori.engine.engine import LLMEngine
from nori.engine.launched_step import LaunchedStep
from nori.models.init_checkpoint import init_checkpoint
from nori.sampling.logprobs import TokenLogprobs
from nori.sampling.params import SamplingParams

STORIES = Path(__file__).resolve().parents[2].parent / "shared" / "models" / "stories260K"
ABORTED = "r8"  # aborted once it has streamed ABORT_AFTER tokens
ABORT_AFTER = 5


def _params(pilot: dict[str, Any]) -> list[SamplingParams]:
    """The load's sampling parameters; stops are taken from an unstopped pilot run, so that
    they fire mid-output."""
    stop_token = pilot["r2"]["token_ids"][4]
    text = pilot["r3"]["text"]
    # Three ASCII characters past the first few (random tokenizers also make U+FFFD).
    start = next(
        (i for i in range(4, len(text) - 2) if all(c.isascii() for c in text[i : i + 3])), 0
    )
    stop_text = text[start : start + 3] if start else "no such text"
    return [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.8, seed=1, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_token]),
        SamplingParams(max_tokens=12, temperature=0.0, stop=[stop_text], ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0.0, min_tokens=4, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0.7, top_p=0.9, seed=7, prompt_logprobs=1),
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.9, seed=3, ignore_eos=True),
    ]


def _unstopped(count: int) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)] * count


def _prompts(vocab_size: int) -> list[list[int]]:
    return [[(11 * i + 5 * j) % (vocab_size - 3) + 3 for j in range(3 + 4 * i)] for i in range(10)]


def _ranked(entries: list[TokenLogprobs | None] | None) -> list[Any] | None:
    """Logprob entries without their values: the tokens, ranks and top tokens."""
    if entries is None:
        return None
    return [
        None if e is None else (e.token_id, e.rank, [token for token, _ in e.top]) for e in entries
    ]


def _values(entries: list[TokenLogprobs | None] | None) -> list[float]:
    return [
        value
        for e in entries or []
        if e is not None
        for value in (e.logprob, *dict(e.top).values())
    ]


def _run(engine: LLMEngine, params: list[SamplingParams], *, defer: bool) -> dict[str, Any]:
    """Every request's final output; `defer`: False resolves each step at once (the reference).
    Counts the steps left in flight under "deferred"."""
    deferred = 0
    decide = LaunchedStep.defers

    def defers(step: LaunchedStep, speculating: bool) -> bool:
        nonlocal deferred
        answer = defer and decide(step, speculating)
        deferred += answer
        return answer

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LaunchedStep, "defers", defers)
        final = _serve(engine, params)
    final["deferred"] = deferred
    return final


def _serve(engine: LLMEngine, params: list[SamplingParams]) -> dict[str, Any]:
    prompts = _prompts(engine.model.config.vocab_size)
    for index, (prompt, sampling) in enumerate(zip(prompts, params, strict=False)):
        engine.add_request(f"r{index}", prompt, sampling)
    final: dict[str, Any] = {}
    streamed: dict[str, int] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            streamed[output.request_id] = len(output.token_ids)
            if output.finished:
                final[output.request_id] = {
                    "token_ids": output.token_ids,
                    "text": output.text,
                    "finish": (output.finish_reason, output.stop_reason),
                    "logprobs": _ranked(output.logprobs),
                    "prompt_logprobs": _ranked(output.prompt_logprobs),
                    "logprob_values": _values(output.logprobs) + _values(output.prompt_logprobs),
                }
        if streamed.get(ABORTED, 0) >= ABORT_AFTER and ABORTED not in final:
            engine.abort_request(ABORTED)
            final[ABORTED] = {"token_ids": "aborted at", "count": streamed[ABORTED]}
    engine.kv_cache.check_invariants()
    load = engine.load()
    assert load.num_free_blocks == load.num_total_blocks
    final["preemptions"] = load.num_preemptions
    return final


def _engine(model: Path) -> LLMEngine:
    config = EngineConfig(
        model=str(model),
        dtype="float32",
        block_size=4,
        num_kv_blocks=24,
        max_num_seqs=8,
        max_num_batched_tokens=16,
    )
    return LLMEngine(config)


@pytest.mark.parametrize("arch", ["tiny", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe", "stories"])
def test_overlapped_steps_give_the_tokens_of_resolving_each_step(arch: str, tmp_path: Path) -> None:
    if arch == "stories":
        if not (STORIES / "config.json").exists():
            pytest.skip(f"stories260K not found at {STORIES}")
        model = STORIES
    else:
        model = init_checkpoint(tmp_path / arch, arch, seed=5)
    pilot = _run(_engine(model), _unstopped(10), defer=False)
    params = _params(pilot)
    reference = _run(_engine(model), params, defer=False)
    overlapped = _run(_engine(model), params, defer=True)
    assert reference.pop("deferred") == 0
    assert overlapped.pop("deferred") > 10, "the plain steps were meant to stay pending"
    assert overlapped.pop("preemptions") > 0 and reference.pop("preemptions") > 0
    # A step carries rows past a stop: other batch shapes, so float sums may differ in the
    # last bits (the logprob values); tokens, ranks and text are exact.
    for name, output in reference.items():
        if "logprob_values" in output:
            expected = output.pop("logprob_values")
            assert overlapped[name].pop("logprob_values") == pytest.approx(expected, abs=1e-4)
    assert overlapped == reference
    # The stops fired before max_tokens, and the abort cut its request short.
    assert reference["r2"]["finish"] == ("stop", params[2].stop_token_ids[0])
    if params[3].stop != ("no such text",):
        assert reference["r3"]["finish"][0] == "stop" and len(reference["r3"]["token_ids"]) < 12
    else:
        assert arch != "stories", "stories260K's text has a stop string to find"
    assert reference[ABORTED]["count"] < params[8].max_tokens


def test_a_plain_step_resolves_after_the_next_is_launched(tmp_path: Path) -> None:
    """The first step (the prompt) outputs nothing: its token is pending until the second step,
    which reads it on the device, has been launched."""
    model = init_checkpoint(tmp_path / "tiny", "tiny", seed=5)
    engine = _engine(model)
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0))
    assert engine.step() == []
    (request,) = engine._scheduler.running
    assert request.num_pending_tokens == 1 and request.token_ids == [5, 6, 7]
    first = engine.step()
    assert [len(output.token_ids) for output in first] == [1]
    assert request.num_pending_tokens == 1 and request.num_computed_tokens == 4
    # The third token is the last: the scheduler runs nothing more, and it resolves.
    assert [len(output.token_ids) for output in engine.step()] == [2]
    (last,) = engine.step()
    assert last.finished and len(last.token_ids) == 3
    assert not engine.has_unfinished_requests()
