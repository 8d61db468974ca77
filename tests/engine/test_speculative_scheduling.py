"""Speculative decoding's pure parts: n-gram prompt lookup, the scheduler granting draft tokens,
and the rollback of rejected drafts, to the exact block id."""

from __future__ import annotations

import pytest

from nori.engine.block_manager import BlockManager
from nori.engine.config import SchedulerConfig, SpeculativeConfig
from nori.engine.request import Request, RequestStatus
from nori.engine.scheduler import Scheduler
from nori.engine.speculative import ngram_drafts
from tests.engine.helpers import make_request


def test_ngram_takes_the_longest_recurring_suffix() -> None:
    # "2 3" recurs (twice) and so does "3": the longest suffix wins, its latest occurrence.
    tokens = [1, 2, 3, 9, 9, 2, 3, 7, 8, 5, 2, 3]
    assert ngram_drafts(tokens, 1, 3, 4) == [7, 8, 5, 2]
    assert ngram_drafts(tokens, 1, 3, 2) == [7, 8]
    # Only 1-grams allowed: "3" last occurred before "7 8 ...".
    assert ngram_drafts(tokens, 1, 1, 3) == [7, 8, 5]


def test_ngram_respects_the_minimum_and_the_end() -> None:
    tokens = [4, 5, 6, 1, 2, 6]
    assert ngram_drafts(tokens, 2, 3, 3) == []  # "2 6" never occurred before
    assert ngram_drafts(tokens, 1, 3, 3) == [1, 2, 6]
    # A match near the end proposes what there is, overlapping the suffix itself.
    assert ngram_drafts([7, 7, 7], 1, 2, 5) == [7]
    assert ngram_drafts([3], 1, 3, 2) == []
    assert ngram_drafts([1, 2, 1], 1, 3, 0) == []


def test_config_parses_vllm_json_and_refuses_bad_values() -> None:
    config = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'
    )
    assert config.lookup_range == (3, 3)
    assert SpeculativeConfig("ngram", 2).lookup_range == (5, 5)  # vLLM's defaults
    assert SpeculativeConfig.parse(config.as_json()) == config
    for bad, message in [
        ("{", "not valid JSON"),
        ('{"method": "ngram"}', "num_speculative_tokens"),
        ('{"method": "medusa", "num_speculative_tokens": 2}', "method"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', ">= 1"),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', "model"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "nope": 1}', "unknown"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
            '"prompt_lookup_max": 2}',
            "prompt_lookup",
        ),
    ]:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.parse(bad)


def _decoding(scheduler: Scheduler, *prompts: list[int]) -> list[Request]:
    """Requests "a", "b", ... whose prompts are computed and whose first token is sampled: they
    decode next."""
    requests = [
        make_request(chr(ord("a") + index), prompt, max_new_tokens=64)
        for index, prompt in enumerate(prompts)
    ]
    for request in requests:
        scheduler.add(request)
    scheduler.update(scheduler.schedule())
    for request in requests:
        request.append_token(99)
    return requests


def test_drafts_get_slots_and_rejected_ones_give_them_back() -> None:
    manager = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64), manager)
    (request,) = _decoding(scheduler, [10, 11, 12, 13, 14, 15])  # 6 tokens: blocks 0, 1
    assert request.block_ids == [0, 1]
    assert request.num_computed_tokens == 6 and request.num_tokens == 7

    # The last token (position 6) and 4 drafts (positions 7-10): blocks 1 and 2 cover them.
    output = scheduler.schedule({"a": 4})
    (item,) = output.scheduled
    assert (item.num_new_tokens, item.num_spec_tokens, item.samples) == (5, 4, True)
    assert request.block_ids == [0, 1, 2]

    # One draft accepted (it joins the tokens), three rejected: computed through position 7,
    # and the blocks of positions past the next token are given back: block 2 stays (position
    # 8 is the token sampled from this step).
    request.append_token(20)
    scheduler.update(output, {"a": 3})
    assert request.num_computed_tokens == 8
    assert request.block_ids == [0, 1, 2]
    # Block 0 and block 1 (positions 4-7) are full of accepted tokens: both are published.
    assert request.num_published_blocks == 2

    # All rejected from a longer reach: the tail block goes back to the free queue.
    request.append_token(21)  # position 8
    output = scheduler.schedule({"a": 4})  # positions 8-12: blocks 2 and 3
    assert request.block_ids == [0, 1, 2, 3]
    scheduler.update(output, {"a": 4})
    assert request.num_computed_tokens == 9
    assert request.block_ids == [0, 1, 2]
    assert manager.num_free_blocks == 5
    manager.check_invariants([request])


def test_drafts_share_the_budget_with_every_decode() -> None:
    manager = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=6), manager)
    first, second = _decoding(scheduler, [1, 2, 3], [4, 5, 6])  # blocks 0 and 1
    assert (first.block_ids, second.block_ids) == ([0], [1])
    # Budget 3 tokens: one is kept for "b"'s decode, so "a" verifies 1 draft (positions 3-4,
    # block 2 for position 4) and "b" decodes plainly.
    scheduler.config = SchedulerConfig(max_num_batched_tokens=3)
    output = scheduler.schedule({"a": 5, "b": 5})
    granted = {item.request.request_id: item.num_spec_tokens for item in output.scheduled}
    assert granted == {"a": 1, "b": 0}
    assert (first.block_ids, second.block_ids) == ([0, 2], [1])
    # Decodes first, then the verification.
    assert [item.request.request_id for item in output.scheduled] == ["b", "a"]


def test_drafts_never_preempt() -> None:
    manager = BlockManager(num_blocks=2, block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(), manager)
    (request,) = _decoding(scheduler, [1, 2, 3, 4, 5, 6, 7])  # blocks 0, 1; next position 7
    # Drafts at positions 8-10 would need a third block: the step decodes plainly instead.
    output = scheduler.schedule({"a": 3})
    (item,) = output.scheduled
    assert (item.num_new_tokens, item.num_spec_tokens) == (1, 0)
    assert not output.preempted and request.status is RequestStatus.RUNNING
    assert request.block_ids == [0, 1]
