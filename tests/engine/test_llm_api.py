"""`LLM.generate` and `LLM.chat` on vLLM's shapes: one `RequestOutput` per prompt, its `outputs`
the prompt's n completions, each checked against the engine run by hand."""

from __future__ import annotations

import functools
import io

import pytest
from tqdm import tqdm

from nori import CompletionOutput, RequestOutput
from nori.engine.llm import LLM
from nori.engine.outputs import StepOutput as EngineOutput
from nori.models.init_checkpoint import init_checkpoint
from nori.sampling.params import SamplingParams

PROMPTS = ["the cat sat on the mat", "once upon a time there was"]
SAMPLED = SamplingParams(n=3, seed=7, temperature=1.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    folder = tmp_path_factory.mktemp("tiny")
    init_checkpoint(folder, "tiny", seed=13)
    return LLM(str(folder), dtype="float32", block_size=8, num_kv_blocks=128)


def by_hand(llm: LLM, prompt: str | list[int], params: SamplingParams) -> EngineOutput:
    """The engine's own final output for one request, without the offline API."""
    llm.engine.add_request("by-hand", prompt, params)
    final = None
    while llm.engine.has_unfinished_requests():
        for output in llm.engine.step():
            if output.finished:
                final = output
    assert final is not None
    return final


def test_outputs_have_vllms_shape(llm: LLM) -> None:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert len(outputs) == 2 and len({o.request_id for o in outputs}) == 2
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert isinstance(output, RequestOutput) and output.finished
        assert output.prompt == prompt
        assert output.prompt_token_ids == llm.tokenizer.encode(prompt)
        assert output.prompt_logprobs is None and output.num_cached_tokens is not None
        (completion,) = output.outputs
        assert isinstance(completion, CompletionOutput) and completion.finished()
        expected = by_hand(llm, prompt, params)
        assert completion.index == 0
        assert completion.token_ids == expected.token_ids and len(completion.token_ids) == 6
        assert completion.text == expected.text
        assert (completion.finish_reason, completion.stop_reason) == ("length", None)
        # Without logprobs asked for, none are reported, and no cumulative one either.
        assert completion.logprobs is None and completion.cumulative_logprob is None
    assert outputs[0].outputs[0].text == outputs[0].outputs[-1].text


def test_n_completions_are_the_seeded_choices(llm: LLM) -> None:
    """n=3 with seed s: completion i is the request sampled alone with seed s + i (what the
    gateway's choice i is), they differ, and a second run gives the same."""
    outputs = llm.generate(PROMPTS, SAMPLED, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert [c.index for c in output.outputs] == [0, 1, 2]
        assert all(c.finish_reason == "length" and len(c.token_ids) == 12 for c in output.outputs)
        for completion in output.outputs:
            alone = SamplingParams(
                seed=7 + completion.index, temperature=1.0, max_tokens=12, ignore_eos=True
            )
            expected = by_hand(llm, prompt, alone)
            assert completion.token_ids == expected.token_ids
            assert completion.text == expected.text
        assert len({tuple(c.token_ids) for c in output.outputs}) == 3
    again = llm.generate(PROMPTS, SAMPLED, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in again] == [
        [c.token_ids for c in o.outputs] for o in outputs
    ]
    assert llm.engine.load().num_free_blocks == 128


def test_n_without_a_seed_draws_each_completion_on_its_own(llm: LLM) -> None:
    params = SamplingParams(n=4, temperature=1.0, max_tokens=12, ignore_eos=True)
    [output] = llm.generate(PROMPTS[0], params, use_tqdm=False)
    assert [c.index for c in output.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in output.outputs}) > 1


def test_logprobs_per_completion(llm: LLM) -> None:
    params = SamplingParams(n=2, seed=3, max_tokens=5, logprobs=2, ignore_eos=True)
    [output] = llm.generate(PROMPTS[1], params, use_tqdm=False)
    for completion in output.outputs:
        assert completion.logprobs is not None and len(completion.logprobs) == 5
        sampled = []
        for token_id, step in zip(completion.token_ids, completion.logprobs, strict=True):
            # The sampled token first, then the top 2 (one of which it may be).
            assert next(iter(step)) == token_id and 2 <= len(step) <= 3
            assert step[token_id].decoded_token == llm.tokenizer.decode(
                [token_id], skip_special_tokens=False
            )
            sampled.append(step[token_id].logprob)
        assert completion.cumulative_logprob == pytest.approx(sum(sampled))


def test_token_id_prompts_report_no_prompt_text(llm: LLM) -> None:
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    ids = llm.tokenizer.encode(PROMPTS[0])
    from_text = llm.generate(PROMPTS[0], greedy, use_tqdm=False)[0]
    forms: list = [ids, [ids], {"prompt_token_ids": ids}, [{"prompt_token_ids": ids}]]
    for form in forms:
        [output] = llm.generate(form, greedy, use_tqdm=False)
        assert output.prompt is None and output.prompt_token_ids == ids
        assert output.outputs[0].token_ids == from_text.outputs[0].token_ids
    [as_dict] = llm.generate({"prompt": PROMPTS[0]}, greedy, use_tqdm=False)
    assert as_dict.prompt == PROMPTS[0]
    assert as_dict.outputs[0].token_ids == from_text.outputs[0].token_ids
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate({"prompt": "a", "prompt_token_ids": [5]}, greedy, use_tqdm=False)
    with pytest.raises(ValueError, match="n must be an int >= 1"):
        SamplingParams(n=0)


def test_chat_reports_the_rendered_prompt_and_n_completions(llm: LLM) -> None:
    messages = [{"role": "user", "content": "hello"}]
    [output] = llm.chat(messages, SAMPLED, use_tqdm=False)
    rendered = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert output.prompt == rendered
    ids = llm.tokenizer.encode(rendered, add_special_tokens=False)
    assert output.prompt_token_ids == ids
    [from_ids] = llm.generate([ids], SAMPLED, use_tqdm=False)
    assert [c.token_ids for c in output.outputs] == [c.token_ids for c in from_ids.outputs]
    # A template of the caller's own, as vLLM's chat(chat_template=...).
    template = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
    [own] = llm.chat([messages], SamplingParams(max_tokens=2), False, chat_template=template)
    assert own.prompt == "<hello>"


def test_the_progress_bar_counts_prompts_and_token_speeds(
    llm: LLM, capsys: pytest.CaptureFixture[str]
) -> None:
    params = SamplingParams(n=2, seed=1, max_tokens=4, ignore_eos=True)
    llm.generate(PROMPTS, params, use_tqdm=False)
    assert capsys.readouterr().err == ""
    llm.generate(PROMPTS, params)  # on by default, on stderr, as vLLM's
    drawn = capsys.readouterr().err
    assert "Processed prompts: 100%" in drawn and "4/4" in drawn
    assert "est. speed input:" in drawn and "output:" in drawn and "toks/s" in drawn
    # A tqdm class of the caller's own draws it (vLLM accepts one too).
    buffer = io.StringIO()
    llm.generate(PROMPTS, params, use_tqdm=functools.partial(tqdm, file=buffer))
    assert "4/4" in buffer.getvalue() and "output:" in buffer.getvalue()
    assert capsys.readouterr().err == ""


def test_a_batch_with_a_bad_prompt_leaves_no_request_behind(llm: LLM) -> None:
    free = llm.engine.load().num_free_blocks
    with pytest.raises(ValueError):
        llm.generate([PROMPTS[0], [10**9]], SAMPLED, use_tqdm=False)
    assert llm.engine.load().num_free_blocks == free and not llm.engine.has_unfinished_requests()
