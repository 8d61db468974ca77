"""Sampled speculative decoding keeps the model's distribution, in the engine.

stories260K at temperature 1 with top_k 4 (a vocabulary of 4 tokens per position), 1,200
seeded requests of 3 tokens each, with and without speculation (n-gram lookups, and a draft
model: the target's first 3 of 5 layers). The 2nd and 3rd tokens come out of verifications (their drafts
accepted, or resampled from the residual after a rejection). A two-sample chi-square test of
homogeneity compares their frequencies at significance 0.001. The same test with the acceptance
rule swapped for a wrong one (always accept a draft) must fail it: that is the test's power.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from nori.engine.config import EngineConfig, SpeculativeConfig
from nori.engine.engine import LLMEngine
from nori.models.truncate import truncate_layers
from nori.sampling import speculative
from nori.sampling.params import SamplingParams

STORIES = Path(__file__).resolve().parents[2].parent / "shared" / "models" / "stories260K"
# Prompts whose drafts the model accepts some of the time (about 20% of n-gram drafts, 30% of
# the draft model's): a rule that accepts too often or too rarely moves the frequencies.
PROMPTS = {
    "ngram": "She had a red ball and a blue ball and a",
    "draft": "The little dog saw the cat. The little dog saw the cat. The little",
}
NUM_SAMPLES = 1200
SIGNIFICANCE = 0.001


def sample(prompt: str, spec: SpeculativeConfig | None) -> tuple[list[tuple[int, ...]], LLMEngine]:
    engine = LLMEngine(
        EngineConfig(model=str(STORIES), dtype="float32", speculative_config=spec, seed=5)
    )
    for index in range(NUM_SAMPLES):
        params = SamplingParams(
            max_tokens=3, temperature=1.0, top_k=4, seed=1000 + index, ignore_eos=True
        )
        engine.add_request(str(index), prompt, params)
    tokens = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                tokens[output.request_id] = tuple(output.token_ids)
    return [tokens[str(i)] for i in range(NUM_SAMPLES)], engine


def homogeneity_p_value(first: list[int], second: list[int]) -> float:
    """Two-sample chi-square test of homogeneity; categories with fewer than 10 samples in
    both together are pooled into one."""
    from scipy.stats import chi2_contingency

    counts_a, counts_b = Counter(first), Counter(second)
    common = [k for k in counts_a.keys() | counts_b.keys() if counts_a[k] + counts_b[k] >= 10]
    table = [[counts_a[k] for k in common], [counts_b[k] for k in common]]
    rare_a = len(first) - sum(table[0])
    rare_b = len(second) - sum(table[1])
    if rare_a + rare_b:
        table[0].append(rare_a)
        table[1].append(rare_b)
    return float(chi2_contingency(table).pvalue)


@pytest.fixture(scope="module", params=["ngram", "draft"])
def method(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def plain(method: str) -> list[tuple[int, ...]]:
    """The samples without speculation, for the prompt of `method`."""
    if not (STORIES / "config.json").exists():
        pytest.skip(f"stories260K not found at {STORIES}")
    return sample(PROMPTS[method], None)[0]


def spec_config(method: str, tmp: Path) -> SpeculativeConfig:
    if method == "ngram":
        return SpeculativeConfig("ngram", 2, prompt_lookup_min=1, prompt_lookup_max=3)
    return SpeculativeConfig("draft_model", 2, model=str(truncate_layers(STORIES, tmp / "d", 3)))


def p_values(plain: list[tuple[int, ...]], speculated: list[tuple[int, ...]]) -> list[float]:
    """Per position after the first (those that verifications produce)."""
    return [homogeneity_p_value([s[i] for s in plain], [s[i] for s in speculated]) for i in (1, 2)]


def test_speculation_keeps_the_distribution(
    plain: list[tuple[int, ...]], method: str, tmp_path: Path
) -> None:
    speculated, engine = sample(PROMPTS[method], spec_config(method, tmp_path))
    counts = engine.load().spec_decode
    assert counts.num_accepted_tokens > 50, counts
    assert counts.num_accepted_tokens < counts.num_draft_tokens, counts
    assert min(p_values(plain, speculated)) > SIGNIFICANCE


def test_a_wrong_acceptance_rule_fails_the_same_test(
    plain: list[tuple[int, ...]], method: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(speculative, "_acceptance_threshold", lambda p, q: p.new_ones(p.shape))
    speculated, _ = sample(PROMPTS[method], spec_config(method, tmp_path))
    assert min(p_values(plain, speculated)) < SIGNIFICANCE
