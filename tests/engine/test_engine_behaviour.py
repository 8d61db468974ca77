"""Engine behaviour beyond fidelity: stops, seeds, logprobs, aborts, bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nori.engine.llm import LLM
from nori.models.init_checkpoint import init_checkpoint
from nori.sampling.params import SamplingParams


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    folder = tmp_path_factory.mktemp("tiny")
    init_checkpoint(folder, "tiny", seed=11)
    return LLM(str(folder), dtype="float32", block_size=8, num_kv_blocks=128)


PROMPTS = ["the cat sat on the mat", "a b c", "once upon a time there was"]


def test_seeded_sampling_is_reproducible_across_batches(llm: LLM) -> None:
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=99, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], params)[0].outputs[0]
    batched = llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]], params)[1].outputs[0]
    assert alone.token_ids == batched.token_ids
    other_seed = llm.generate(PROMPTS[0], SamplingParams(max_tokens=20, seed=100, ignore_eos=True))
    assert other_seed[0].outputs[0].token_ids != alone.token_ids


def test_stop_token_ids_and_max_tokens(llm: LLM) -> None:
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    reference = llm.generate(PROMPTS[2], greedy)[0].outputs[0]
    assert reference.finish_reason == "length" and len(reference.token_ids) == 12
    stop_id = reference.token_ids[4]
    first = reference.token_ids.index(stop_id)
    stopped = llm.generate(
        PROMPTS[2],
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_id]),
    )[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_id
    assert stopped.token_ids == reference.token_ids[: first + 1]


def test_stop_string_truncates_text(llm: LLM) -> None:
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    reference = llm.generate(PROMPTS[0], greedy)[0].outputs[0]
    text = reference.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    if not stop.strip():
        pytest.skip("greedy text has no usable stop substring")
    stopped = llm.generate(
        PROMPTS[0], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=[stop])
    )[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.text == text[: text.index(stop)]


def test_logprobs_are_log_softmax_of_model_logits(llm: LLM) -> None:
    output = llm.generate(
        PROMPTS[1], SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, ignore_eos=True)
    )[0].outputs[0]
    assert output.logprobs is not None and len(output.logprobs) == 4
    for token_id, entry in zip(output.token_ids, output.logprobs, strict=True):
        # vLLM's layout: the sampled token first, then the top 3 (greedy: it is the top one).
        assert next(iter(entry)) == token_id and entry[token_id].rank == 1
        assert len(entry) == 3 and [e.rank for e in entry.values()] == [1, 2, 3]
        assert entry[token_id].logprob == pytest.approx(max(e.logprob for e in entry.values()))
        assert entry[token_id].decoded_token == llm.tokenizer.decode(
            [token_id], skip_special_tokens=False
        )
        probabilities = torch.tensor([e.logprob for e in entry.values()]).exp()
        assert float(probabilities.sum()) <= 1.0 + 1e-6
    sampled = [entry[t].logprob for t, entry in zip(output.token_ids, output.logprobs, strict=True)]
    assert output.cumulative_logprob == pytest.approx(sum(sampled))


def test_streaming_deltas_add_up(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("stream", PROMPTS[0], SamplingParams(max_tokens=10, ignore_eos=True))
    pieces, tokens, final = [], [], None
    while engine.has_unfinished_requests():
        for output in engine.step():
            pieces.append(output.new_text)
            tokens.extend(output.new_token_ids)
            final = output
    assert final is not None and final.finished
    assert "".join(pieces) == final.text and tokens == final.token_ids


def test_abort_frees_blocks_at_once(llm: LLM) -> None:
    engine = llm.engine
    free = engine.load().num_free_blocks
    engine.add_request("a", list(range(3, 60)), SamplingParams(max_tokens=50))
    engine.add_request("b", list(range(3, 30)), SamplingParams(max_tokens=50))
    engine.step()
    engine.step()
    assert engine.load().num_free_blocks < free
    engine.abort_request("a")
    engine.abort_request("b")
    assert engine.load().num_free_blocks == free
    assert not engine.has_unfinished_requests()
    engine.kv_cache.check_invariants()


def test_bad_input_is_a_clear_error_and_loses_nothing(llm: LLM) -> None:
    engine = llm.engine
    free = engine.load().num_free_blocks
    with pytest.raises(ValueError, match="out of range"):
        engine.add_request("x", [1, 2, 10**6], SamplingParams())
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request("x", [], SamplingParams())
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("x", [5] * engine.model.max_model_len, SamplingParams())
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", [5, 6], SamplingParams(max_tokens=2))
        engine.add_request("dup", [5, 6], SamplingParams(max_tokens=2))
    engine.abort_request("dup")
    assert engine.load().num_free_blocks == free and not engine.has_unfinished_requests()


def test_generation_stops_at_max_model_len(tmp_path: Path) -> None:
    init_checkpoint(tmp_path, "tiny", seed=2)
    llm = LLM(str(tmp_path), dtype="float32", num_kv_blocks=256, block_size=8, max_model_len=24)
    output = llm.generate([5] * 20, SamplingParams(max_tokens=100, ignore_eos=True))[0].outputs[0]
    assert output.finish_reason == "length" and len(output.token_ids) == 4


def test_chat_uses_the_template(llm: LLM) -> None:
    output = llm.chat(
        [{"role": "user", "content": "hello"}], SamplingParams(max_tokens=3, ignore_eos=True)
    )[0]
    rendered = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello"}], add_generation_prompt=True
    )
    assert output.prompt == rendered  # as vLLM reports a chat's prompt
    # The template writes BOS itself: encoding adds no second one.
    assert output.prompt_token_ids == llm.tokenizer.encode(rendered, add_special_tokens=False)
    assert output.prompt_token_ids.count(llm.tokenizer.bos_token_id) <= 1


def test_a_small_model_on_cpu_takes_no_more_kv_than_its_sequences_can_fill(
    tmp_path: Path,
) -> None:
    init_checkpoint(tmp_path, "tiny", seed=1)  # 1024 positions
    small = LLM(
        str(tmp_path),
        device="cpu",
        dtype="float32",
        block_size=16,
        max_num_seqs=4,
        max_model_len=256,
    )
    # 4 sequences of 256 tokens = 64 blocks (and one spare), not the 1 GiB default's ~131000.
    assert small.engine.load().num_total_blocks == 4 * 256 // 16 + 1
    given = LLM(
        str(tmp_path),
        device="cpu",
        dtype="float32",
        block_size=16,
        max_num_seqs=4,
        num_kv_blocks=500,
    )
    assert given.engine.load().num_total_blocks == 500  # an explicit size is kept


def test_the_top_level_names_are_vllms() -> None:
    import nori
    from nori.engine.completion_outputs import CompletionOutput, RequestOutput
    from nori.engine.config import EngineConfig
    from nori.engine.llm import LLM as EngineLLM
    from nori.sampling.params import SamplingParams as Params

    assert (nori.LLM, nori.EngineConfig, nori.SamplingParams) == (EngineLLM, EngineConfig, Params)
    assert (nori.RequestOutput, nori.CompletionOutput) == (RequestOutput, CompletionOutput)
    assert set(nori.__all__) == {
        "LLM",
        "EngineConfig",
        "SamplingParams",
        "RequestOutput",
        "CompletionOutput",
    }
