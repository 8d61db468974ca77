from __future__ import annotations

import math

import pytest
import torch

from nori.sampling.batch import RowState, SamplingBatch, make_generator
from nori.sampling.params import SamplingParams
from nori.sampling.sampler import Sampler, SamplerOutput
from nori.sampling.truncation import apply_min_p, apply_top_k_top_p

NEG = float("-inf")


def run(
    logits: torch.Tensor,
    params: list[SamplingParams],
    outputs: list[list[int]] | None = None,
    prompts: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
    eos: tuple[int, ...] = (),
    sampler: Sampler | None = None,
) -> SamplerOutput:
    rows = [
        RowState(
            p,
            prompts[i] if prompts else [],
            outputs[i] if outputs else [],
            generators[i] if generators else None,
        )
        for i, p in enumerate(params)
    ]
    batch = SamplingBatch.build(rows, "cpu", eos)
    return (sampler or Sampler(torch.Generator().manual_seed(0)))(logits, batch)


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor([probs]).log()


def kept(logits: torch.Tensor) -> list[int]:
    return torch.isfinite(logits[0]).nonzero().flatten().tolist()


def test_greedy_is_argmax() -> None:
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(1))
    out = run(logits, [SamplingParams(temperature=0.0)] * 8)
    assert out.token_tensor.tolist() == logits.argmax(-1).tolist()
    assert out.logprobs is None


def test_greedy_rows_in_mixed_batch_are_argmax() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.5, top_k=5) for i in range(6)]
    out = run(logits, params)
    for i in range(1, 6, 2):
        assert out.token_tensor.tolist()[i] == int(logits[i].argmax())


def test_top_k_keeps_k_most_likely() -> None:
    logits = logits_of([0.1, 0.4, 0.05, 0.3, 0.15])
    masked = apply_top_k_top_p(logits, torch.tensor([2]), None, max_top_k=2)
    assert kept(masked) == [1, 3]
    assert torch.equal(masked[0, [1, 3]], logits[0, [1, 3]])  # survivors untouched
    # through the sort path (with top_p off for this row) too
    masked = apply_top_k_top_p(logits, torch.tensor([3]), torch.tensor([1.0]))
    assert kept(masked) == [1, 3, 4]


def test_top_k_off_rows_untouched() -> None:
    logits = torch.randn(2, 10)
    masked = apply_top_k_top_p(logits, torch.tensor([0, 3]), None, max_top_k=3)
    assert torch.equal(masked[0], logits[0])
    assert torch.isfinite(masked[1]).sum() == 3


def test_top_p_smallest_set_reaching_p() -> None:
    logits = logits_of([0.1, 0.4, 0.05, 0.3, 0.15])  # sorted: .4 .3 .15 .1 .05
    assert kept(apply_top_k_top_p(logits, None, torch.tensor([0.35]))) == [1]
    assert kept(apply_top_k_top_p(logits, None, torch.tensor([0.65]))) == [1, 3]
    assert kept(apply_top_k_top_p(logits, None, torch.tensor([0.72]))) == [1, 3, 4]
    assert kept(apply_top_k_top_p(logits, None, torch.tensor([0.9]))) == [0, 1, 3, 4]
    assert kept(apply_top_k_top_p(logits, None, torch.tensor([1.0]))) == [0, 1, 2, 3, 4]


def test_top_p_after_top_k_renormalises() -> None:
    # top-k=2 leaves .4/.7 and .3/.7 (= .571, .429); p=0.5 then keeps only the first.
    logits = logits_of([0.1, 0.4, 0.05, 0.3, 0.15])
    assert kept(apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([0.5]))) == [1]
    assert kept(apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([0.6]))) == [1, 3]


def test_min_p_relative_to_top_token() -> None:
    logits = logits_of([0.1, 0.4, 0.05, 0.3, 0.15])
    # threshold 0.3 * 0.4 = 0.12: keeps .4 .3 .15
    assert kept(apply_min_p(logits, torch.tensor([0.3]))) == [1, 3, 4]
    assert kept(apply_min_p(logits, torch.tensor([0.0]))) == [0, 1, 2, 3, 4]
    assert kept(apply_min_p(logits, torch.tensor([1.0]))) == [1]


def test_truncation_limits_sampled_tokens() -> None:
    logits = logits_of([0.1, 0.4, 0.05, 0.3, 0.15]).repeat(200, 1)
    out = run(logits, [SamplingParams(top_k=2)] * 200)
    assert set(out.token_tensor.tolist()) == {1, 3}
    out = run(logits, [SamplingParams(min_p=0.3)] * 200)
    assert set(out.token_tensor.tolist()) == {1, 3, 4}


def test_repetition_penalty_hand_computed() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    batch = SamplingBatch.build(
        [RowState(SamplingParams(temperature=0, repetition_penalty=2.0), [0], [1, 1])], "cpu"
    )
    from nori.sampling.penalties import apply_penalties

    result = apply_penalties(logits, batch)
    assert result.tolist() == [[1.0, -2.0, 0.5, 3.0, -2.0]]


def test_frequency_and_presence_hand_computed() -> None:
    from nori.sampling.penalties import apply_penalties

    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    # prompt tokens never count for frequency/presence penalties
    batch = SamplingBatch.build([RowState(params, [2, 2, 2], [3, 3, 1, 3])], "cpu")
    result = apply_penalties(logits, batch)
    expected = [2.0, -1.0 - 0.5 - 0.25, 0.5, 3.0 - 1.5 - 0.25, -2.0]
    assert result[0].tolist() == pytest.approx(expected)


def test_penalties_change_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    out = run(logits, [SamplingParams(temperature=0, presence_penalty=1.0)], outputs=[[0]])
    assert out.token_tensor.tolist() == [1]


def test_min_tokens_bans_eos_and_stop_ids() -> None:
    logits = torch.tensor([[0.0, 5.0, 0.0, 4.0, 1.0]] * 3)
    params = [
        SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3]),
        SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3]),
        SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3], ignore_eos=True),
    ]
    out = run(logits, params, outputs=[[4], [4, 4], [4]], eos=(1,))
    assert out.token_tensor.tolist() == [
        4,
        1,
        1,
    ]  # banned below min_tokens; free after; ignore_eos: no ban


def test_seeded_rows_independent_of_batch_mates_and_position() -> None:
    vocab = 300
    target = torch.randn(vocab, generator=torch.Generator().manual_seed(5))
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)

    def draw(batch_size: int, position: int, mate_seed: int) -> list[int]:
        noise = torch.Generator().manual_seed(mate_seed)
        gen = make_generator(1234, "cpu")
        tokens = []
        for _ in range(20):
            logits = torch.randn(batch_size, vocab, generator=noise)
            logits[position] = target
            ps = [SamplingParams(temperature=1.3, top_k=7)] * batch_size
            ps[position] = params
            gens: list[torch.Generator | None] = [None] * batch_size
            gens[position] = gen
            out = run(
                logits,
                ps,
                generators=gens,
                sampler=Sampler(torch.Generator().manual_seed(mate_seed)),
            )
            tokens.append(out.token_tensor.tolist()[position])
        return tokens

    reference = draw(1, 0, 0)
    assert len(set(reference)) > 3  # it really samples
    assert draw(5, 3, 1) == reference
    assert draw(9, 0, 2) == reference


def test_temperature_sampling_frequencies() -> None:
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    temperature = 0.7
    expected = torch.softmax(probs.log() / temperature, dim=0)
    n = 20000
    logits = probs.log().repeat(n, 1)
    out = run(logits, [SamplingParams(temperature=temperature)] * n)
    counts = torch.bincount(torch.tensor(out.token_tensor.tolist()), minlength=4).float() / n
    # 5 standard deviations of a binomial proportion: fails by chance ~1e-6, yet catches a
    # missing temperature (0.5 vs 0.62 for the top token) many times over.
    sigma = (expected * (1 - expected) / n).sqrt()
    assert torch.all((counts - expected).abs() < 5 * sigma), (counts, expected)


def test_logprobs_are_raw_log_softmax() -> None:
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    params = [
        SamplingParams(temperature=0.5, repetition_penalty=1.5, logprobs=3),
        SamplingParams(temperature=0, logprobs=0),
        SamplingParams(temperature=0),
        SamplingParams(logprobs=20),
    ]
    out = run(logits, params, outputs=[[1, 2], [], [], []])
    reference = torch.log_softmax(logits, dim=-1)
    assert out.logprobs is not None
    assert out.logprobs[2] is None
    for row in (0, 1, 3):
        entry = out.logprobs[row]
        assert entry is not None
        token = out.token_tensor.tolist()[row]
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(float(reference[row, token]), abs=1e-5)
        assert entry.rank == int((reference[row] > reference[row, token]).sum()) + 1
        count = params[row].logprobs or 0
        top = reference[row].topk(count) if count else None
        assert len(entry.top) == count
        if top is not None:
            assert [t for t, _ in entry.top] == top.indices.tolist()
            assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=1e-5)
    greedy_entry, full_entry = out.logprobs[1], out.logprobs[3]
    assert greedy_entry is not None and greedy_entry.rank == 1
    assert full_entry is not None
    assert math.isclose(
        sum(math.exp(v) for _, v in full_entry.top),
        float(reference[3].exp().topk(20).values.sum()),
        rel_tol=1e-4,
    )


def test_masked_tokens_never_sampled_with_neg_inf_logits() -> None:
    logits = torch.full((500, 10), NEG)
    logits[:, 7] = 0.0
    out = run(logits, [SamplingParams(top_p=0.5, min_p=0.1)] * 500)
    assert set(out.token_tensor.tolist()) == {7}


def test_shape_mismatch_is_rejected() -> None:
    batch = SamplingBatch.build([RowState(SamplingParams(), [], [])], "cpu")
    with pytest.raises(ValueError, match="logits must be"):
        Sampler()(torch.zeros(2, 5), batch)
