"""Speculative verification: greedy runs equal the plain sampler's, sampled runs emit tokens with
the target distribution (a chi-square goodness-of-fit test that wrong acceptance rules fail),
seeded requests reproduce whatever their batch mates, and the rule's edge cases."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from nori.sampling import speculative
from nori.sampling.batch import RowState, SamplingBatch, make_generator
from nori.sampling.params import SamplingParams
from nori.sampling.sampler import Sampler, target_probs
from nori.sampling.speculative import DraftProposal, draw_tokens, verify_drafts

NEG = float("-inf")

# Upper 0.1% points of the chi-square distribution (alpha = 0.001), by degrees of freedom
# (vocabulary size - 1 when every token has mass). Every draw below is seeded, so each check is
# deterministic; alpha says how unlikely a correct rule is to fail on a fresh seed.
CHI2_CRITICAL = {5: 20.515}


def chi_square(tokens: list[int], expected: torch.Tensor) -> float:
    """Pearson's statistic sum((observed - n p)^2 / (n p)) of `tokens` against `expected`."""
    counts = torch.bincount(torch.tensor(tokens), minlength=expected.numel()).double()
    mean = expected.double() * len(tokens)
    return float(((counts - mean) ** 2 / mean).sum())


def request_rows(
    params: SamplingParams,
    output: list[int],
    drafts: list[int],
    prompt: list[int] | None = None,
    generator: torch.Generator | None = None,
) -> list[RowState]:
    """The k + 1 rows of one request: row i sees the output plus the first i drafts."""
    return [
        RowState(params, prompt or [], output + drafts[:i], generator)
        for i in range(len(drafts) + 1)
    ]


def plain_greedy_token(
    logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]
) -> int:
    batch = SamplingBatch.build([RowState(params, prompt, output)], "cpu", eos_token_ids=(0,))
    return int(Sampler()(logits[None], batch).token_tensor[0])


def test_greedy_keeps_exactly_the_plain_greedy_tokens() -> None:
    vocab, k = 40, 4
    noise = torch.Generator().manual_seed(0)
    params = SamplingParams(
        temperature=0, repetition_penalty=1.4, frequency_penalty=0.7, presence_penalty=0.5,
        min_tokens=4,
    )  # fmt: skip
    sampled = SamplingParams(temperature=0.8)
    penalty_changed = 0
    for trial in range(6):
        rows: list[RowState] = []
        logit_rows = []
        proposals = []
        expected = []
        for accepted in range(k + 1):  # one request per accepted-prefix length
            prompt = torch.randint(vocab, (5,), generator=noise).tolist()
            output = torch.randint(vocab, (2,), generator=noise).tolist()
            logits = 2 * torch.randn(k + 1, vocab, generator=noise)
            # A few of the context's tokens lead, so the penalties decide the argmax.
            logits[:, output + prompt[:2]] += 2.5
            drafts: list[int] = []
            targets = []
            for i in range(k + 1):
                target = plain_greedy_token(logits[i], params, prompt, output + drafts)
                penalty_changed += target != int(logits[i].argmax())
                targets.append(target)
                if i < k:
                    other = target + 1 + int(torch.randint(vocab - 1, (), generator=noise))
                    drafts.append(target if i < accepted else other % vocab)
            rows += request_rows(params, output, drafts, prompt)
            logit_rows.append(logits)
            proposals.append(DraftProposal(drafts))
            expected.append(targets[: accepted + 1])
        # A sampled request in the batch too: the greedy ones must not notice it.
        rows += request_rows(sampled, [], [1, 2])
        logit_rows.append(torch.randn(3, vocab, generator=noise))
        proposals.append(DraftProposal([1, 2]))
        batch = SamplingBatch.build(rows, "cpu", eos_token_ids=(0,))
        kept = verify_drafts(torch.cat(logit_rows), batch, proposals, torch.Generator())
        assert kept[:-1] == expected, trial
        assert 1 <= len(kept[-1]) <= 3
    assert penalty_changed > 10  # the extended contexts really matter


# The distribution checks: vocabulary of 6, k = 2, the target's three rows at temperature 0.8.
VOCAB, DRAFTS, DRAWS = 6, 2, 20_000
TEMPERATURE = 0.8
RAW_TARGET = torch.tensor(
    [
        [0.30, 0.25, 0.20, 0.10, 0.10, 0.05],
        [0.10, 0.15, 0.05, 0.40, 0.20, 0.10],
        [0.20, 0.20, 0.20, 0.15, 0.15, 0.10],
    ]
)
TARGET = torch.softmax(RAW_TARGET.log() / TEMPERATURE, dim=-1)  # the p each row must emit with
DRAFT_Q = torch.tensor(
    [
        [0.05, 0.10, 0.15, 0.20, 0.20, 0.30],
        [0.30, 0.05, 0.25, 0.10, 0.10, 0.20],
    ]
)
NGRAM_DRAFTS = [0, 3]  # a one-hot q: p_0(0) = 0.33, p_1(3) = 0.47 after temperature


def always_accept(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(p)


def accept_q_over_p(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return torch.where(p > 0, q / p, torch.zeros_like(p))


def residual_is_p(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return p


def speculative_draws(draft_model: bool) -> list[list[int]]:
    """DRAWS independent requests with the same target rows; drafts drawn from q (or fixed)."""
    params = SamplingParams(temperature=TEMPERATURE)
    # No penalties or bans: the rows' contexts change nothing, so the drafts can stay out.
    batch = SamplingBatch.build([RowState(params, [], [])] * (DRAWS * (DRAFTS + 1)), "cpu")
    logits = RAW_TARGET.log().repeat(DRAWS, 1)
    if draft_model:
        drafts = torch.multinomial(
            DRAFT_Q, DRAWS, replacement=True, generator=torch.Generator().manual_seed(1)
        ).T.tolist()
        proposals = [DraftProposal(d, DRAFT_Q) for d in drafts]
    else:
        proposals = [DraftProposal(NGRAM_DRAFTS)] * DRAWS
    return verify_drafts(logits, batch, proposals, torch.Generator().manual_seed(2))


def statistics(kept: list[list[int]]) -> list[float]:
    """chi-square of the first token against p_0, of the second (first draft accepted) against
    p_1, and of the bonus (both accepted) against p_2."""
    stats = [chi_square([tokens[0] for tokens in kept], TARGET[0])]
    for position in (1, 2):
        tokens = [t[position] for t in kept if len(t) > position]
        assert len(tokens) > 1000  # enough accepted drafts for the check to mean something
        stats.append(chi_square(tokens, TARGET[position]))
    return stats


@pytest.mark.parametrize("draft_model", [True, False], ids=["draft-model-q", "one-hot-q"])
def test_emitted_tokens_follow_the_target_distribution(draft_model: bool) -> None:
    stats = statistics(speculative_draws(draft_model))
    assert max(stats) < CHI2_CRITICAL[5], stats


@pytest.mark.parametrize(
    ("draft_model", "threshold", "residual"),
    [
        (True, always_accept, None),
        (False, always_accept, None),
        (True, accept_q_over_p, None),
        (True, None, residual_is_p),
        (False, None, residual_is_p),
    ],
    ids=["accept-all", "accept-all-ngram", "q-over-p", "resample-p", "resample-p-ngram"],
)
def test_wrong_rules_fail_the_same_check(
    monkeypatch: pytest.MonkeyPatch,
    draft_model: bool,
    threshold: Callable[..., torch.Tensor] | None,
    residual: Callable[..., torch.Tensor] | None,
) -> None:
    if threshold is not None:
        monkeypatch.setattr(speculative, "_acceptance_threshold", threshold)
    if residual is not None:
        monkeypatch.setattr(speculative, "_residual", residual)
    stats = statistics(speculative_draws(draft_model))
    assert stats[0] > CHI2_CRITICAL[5], stats  # the first token gives the rule away


def test_draw_tokens_follows_probs_and_seeds() -> None:
    tokens = draw_tokens(TARGET[0].repeat(DRAWS, 1), [None] * DRAWS, torch.Generator())
    assert chi_square(tokens, TARGET[0]) < CHI2_CRITICAL[5]
    probs = torch.softmax(torch.randn(4, 50, generator=torch.Generator().manual_seed(3)), -1)
    alone = draw_tokens(probs[2:3], [make_generator(7, "cpu")])
    mates = [None, make_generator(8, "cpu"), make_generator(7, "cpu"), None]
    assert draw_tokens(probs, mates, torch.Generator())[2] == alone[0]


def test_seeded_request_ignores_its_batch_mates() -> None:
    vocab, k = 30, 3
    params = SamplingParams(temperature=0.9, top_k=12, presence_penalty=0.3, seed=11)

    def run(mates_before: int, mates_after: int, mate_seed: int) -> list[list[int]]:
        own = torch.Generator().manual_seed(100)  # the request's logits, step after step
        noise = torch.Generator().manual_seed(mate_seed)
        generator = make_generator(11, "cpu")
        output: list[int] = []
        steps = []
        for _ in range(12):
            q = torch.softmax(torch.randn(k, vocab, generator=own), -1)
            drafts = draw_tokens(q, [generator] * k)
            target_logits = torch.randn(k + 1, vocab, generator=own)
            rows, logits, proposals = [], [], []
            for mate in range(mates_before + 1 + mates_after):
                if mate == mates_before:
                    rows += request_rows(params, output, drafts, generator=generator)
                    logits.append(target_logits)
                    proposals.append(DraftProposal(drafts, q))
                    continue
                mate_k = 1 + mate % 4
                mate_params = SamplingParams(temperature=[0, 1.2, 0.7][mate % 3], seed=mate)
                seeded = make_generator(mate, "cpu") if mate % 2 else None
                mate_drafts = torch.randint(vocab, (mate_k,), generator=noise).tolist()
                rows += request_rows(mate_params, [], mate_drafts, generator=seeded)
                logits.append(torch.randn(mate_k + 1, vocab, generator=noise))
                proposals.append(DraftProposal(mate_drafts))
            batch = SamplingBatch.build(rows, "cpu")
            kept = verify_drafts(
                torch.cat(logits), batch, proposals, torch.Generator().manual_seed(mate_seed)
            )[mates_before]
            steps.append(kept)
            output += kept
        return steps

    reference = run(0, 0, 0)
    assert len({len(tokens) for tokens in reference}) > 1  # accepts some drafts, not all
    assert len({t for tokens in reference for t in tokens}) > 5  # it really samples
    assert run(2, 0, 1) == reference
    assert run(3, 4, 2) == reference


def sampled_batch(rows: int) -> SamplingBatch:
    return SamplingBatch.build([RowState(SamplingParams(), [], [])] * rows, "cpu")


def seeded() -> torch.Generator:
    return torch.Generator().manual_seed(5)


def test_draft_with_zero_draft_probability_is_rejected() -> None:
    # p_0 is one-hot on token 0; q_0(0) = 0, so min(1, p/q) would accept, but the draft could
    # not have come from q: a rejection, then the residual max(0, p - q) = p gives token 0.
    logits = torch.full((3, VOCAB), 0.0)
    logits[0, 1:] = NEG
    q = torch.tensor([[0.0, 0.5, 0.5, 0, 0, 0], [1.0 / VOCAB] * VOCAB])
    proposals = [DraftProposal([0, 4], q)] * 200
    kept = verify_drafts(
        logits.repeat(200, 1), sampled_batch(logits.shape[0] * 200), proposals, seeded()
    )
    assert kept == [[0]] * 200


def test_empty_residual_falls_back_to_p() -> None:
    # p_0 = q_0 = half on tokens 0 and 1; draft 3 has q = 0: rejected, residual all zero.
    logits = torch.tensor([[0.0, 0.0, NEG, NEG, NEG, NEG], [0.0] * VOCAB])
    q = torch.tensor([[0.5, 0.5, 0.0, 0.0, 0.0, 0.0]])
    proposals = [DraftProposal([3], q)] * 400
    kept = verify_drafts(
        logits.repeat(400, 1), sampled_batch(logits.shape[0] * 400), proposals, seeded()
    )
    assert {len(tokens) for tokens in kept} == {1}
    assert {tokens[0] for tokens in kept} == {0, 1}  # not a zero-weight race's argmax 0 alone


def test_one_hot_draft_certain_and_impossible() -> None:
    logits = torch.tensor([[NEG, 0.0, NEG, NEG], [0.0, 1.0, NEG, 2.0], [0.0, 0.0, 0.0, 0.0]])
    certain = verify_drafts(
        logits.repeat(100, 1),
        sampled_batch(logits.shape[0] * 100),
        [DraftProposal([1, 2])] * 100,
        seeded(),
    )
    # draft 1 has p = 1: always kept; draft 2 has p = 0: never kept, and never emitted.
    assert {tokens[0] for tokens in certain} == {1}
    assert {len(tokens) for tokens in certain} == {2}
    assert {tokens[1] for tokens in certain} == {0, 1, 3}


def test_target_probs_matches_sampler_stages() -> None:
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(4))
    params = [
        SamplingParams(temperature=0, frequency_penalty=2.0, presence_penalty=2.0),
        SamplingParams(temperature=0.5, top_k=3),
        SamplingParams(min_p=0.2, top_p=0.9),
    ]
    logits[0, 7] = logits[0].max() + 1  # the top token, but in the output: penalised by 4
    rows = [RowState(p, [], [7]) for p in params]
    probs = target_probs(logits, SamplingBatch.build(rows, "cpu"))
    assert probs.dtype == torch.float32
    assert torch.allclose(probs.sum(-1), torch.ones(3))
    assert probs[0].max() == 1 and int(probs[0].argmax()) != 7
    assert int((probs[1] > 0).sum()) == 3
    expected = torch.softmax(logits[1] / 0.5, -1).masked_fill(probs[1] == 0, 0)
    assert torch.allclose(probs[1], expected / expected.sum())


def test_malformed_proposals_are_rejected() -> None:
    with pytest.raises(ValueError, match="at least one draft"):
        DraftProposal([])
    with pytest.raises(ValueError, match="probs must be"):
        DraftProposal([1, 2], torch.ones(1, 5))
    logits = torch.zeros(3, 5)
    with pytest.raises(ValueError, match="rows"):
        verify_drafts(logits, sampled_batch(logits.shape[0]), [DraftProposal([1, 2, 3])])
    with pytest.raises(ValueError, match="outside the vocab"):
        verify_drafts(logits, sampled_batch(logits.shape[0]), [DraftProposal([1, 5])])
    with pytest.raises(ValueError, match="vocab"):
        verify_drafts(
            logits, sampled_batch(logits.shape[0]), [DraftProposal([1, 2], torch.ones(2, 6))]
        )
