"""Scheduler: token budget, chunked prefill mixed with decodes, preemption, abort, static policy."""

from __future__ import annotations

from nori.engine.block_manager import BlockManager
from nori.engine.request import Request, RequestStatus
from nori.engine.scheduler import (
    STATIC_PAD_TOKEN_ID,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from tests.engine.helpers import make_request


def make_scheduler(
    num_blocks: int = 16, block_size: int = 4, max_seqs: int = 8, budget: int = 16, **kwargs: object
) -> Scheduler:
    kwargs.setdefault("admission_watermark", 0.0)
    config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, **kwargs)  # type: ignore[arg-type]
    return Scheduler(config, BlockManager(num_blocks, block_size))


def run_step(scheduler: Scheduler, sampled_token: int = 7) -> SchedulerOutput:
    """One engine step without a model: every request that completes its tokens samples one."""
    output = scheduler.schedule()
    samplers = [s.request for s in output.scheduled if s.samples]
    scheduler.update(output)
    for request in samplers:
        request.append_token(sampled_token)
    return output


def plan(output: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.request.request_id, s.num_new_tokens) for s in output.scheduled]


def test_chunked_prefill_shares_the_budget_with_decodes() -> None:
    scheduler = make_scheduler(budget=8)
    a = make_request("a", list(range(6)))
    b = make_request("b", list(range(100, 120)))
    scheduler.add(a)
    scheduler.add(b)

    assert plan(run_step(scheduler)) == [("a", 6), ("b", 2)]
    assert a.block_ids == [0, 1] and b.block_ids == [2]
    assert a.num_output_tokens == 1 and b.num_output_tokens == 0
    # a decodes (1 token, listed first) while b's prefill continues in the same step.
    assert plan(run_step(scheduler)) == [("a", 1), ("b", 7)]
    assert b.block_ids == [2, 3, 4]
    assert plan(run_step(scheduler)) == [("a", 1), ("b", 7)]
    assert plan(run_step(scheduler)) == [("a", 1), ("b", 4)]
    assert b.num_computed_tokens == 20 and b.num_output_tokens == 1
    assert plan(run_step(scheduler)) == [("a", 1), ("b", 1)]
    scheduler.block_manager.check_invariants(scheduler.requests())


def test_prompt_work_beside_decodes_is_capped_and_chunked() -> None:
    """With decodes running, a step carries at most prefill_budget_with_decodes prompt tokens:
    a long prompt is cut into chunks of that size that ride along with the decodes."""
    scheduler = make_scheduler(num_blocks=32, budget=16, prefill_budget_with_decodes=3)
    a = make_request("a", list(range(5)))
    scheduler.add(a)
    # Nothing decodes yet: the whole budget is open to prompts.
    assert plan(run_step(scheduler)) == [("a", 5)]
    b = make_request("b", list(range(100, 110)))
    c = make_request("c", list(range(200, 202)))
    scheduler.add(b)
    scheduler.add(c)
    # a decodes; b gets the 3 prompt tokens, c waits (the cap is spent).
    assert plan(run_step(scheduler)) == [("a", 1), ("b", 3)]
    assert plan(run_step(scheduler)) == [("a", 1), ("b", 3)]
    assert plan(run_step(scheduler)) == [("a", 1), ("b", 3)]
    # b's last prompt token is a one-token chunk: it leaves 2 of the cap to admit c.
    assert plan(run_step(scheduler)) == [("a", 1), ("b", 1), ("c", 2)]
    assert b.num_output_tokens == 1 and c.num_output_tokens == 1
    # a grew into block 5 in this step (its 9th computed token); c got the next one.
    assert [r.block_ids for r in (a, b, c)] == [[0, 1, 5], [2, 3, 4], [6]]
    assert plan(run_step(scheduler)) == [("a", 1), ("b", 1), ("c", 1)]
    scheduler.block_manager.check_invariants(scheduler.requests())


def test_sequence_limit_keeps_others_waiting() -> None:
    scheduler = make_scheduler(max_seqs=2)
    for name in "abc":
        scheduler.add(make_request(name, [1, 2, 3]))
    assert plan(run_step(scheduler)) == [("a", 3), ("b", 3)]
    assert [r.request_id for r in scheduler.waiting] == ["c"]


def _transferred(scheduler: Scheduler, name: str, prompt: list[int]) -> Request:
    """A request whose prompt K/V arrived from a prefill worker with its first token, as the
    engine's reserve_prompt + complete_transfer leave it: blocks held, then activated."""
    request = make_request(name, prompt)
    assert scheduler.block_manager.allocate(request, len(prompt) + 1)
    request.num_computed_tokens = len(prompt)
    request.append_token(7)
    scheduler.hold(request, RequestStatus.RESERVED)
    scheduler.activate(name)
    return request


def test_arrived_kv_waits_for_a_row_when_the_batch_is_full() -> None:
    """A finished transfer never grows the running batch past max_num_seqs: it keeps its blocks
    and queues (READY) until a running stream ends, then joins as a decode."""
    scheduler = make_scheduler(max_seqs=2, block_size=4)
    a = _transferred(scheduler, "a", [1, 2, 3])
    b = _transferred(scheduler, "b", [4, 5, 6])
    c = _transferred(scheduler, "c", [8, 9, 10])
    assert [r.request_id for r in scheduler.running] == ["a", "b"]
    assert c.status is RequestStatus.READY and list(scheduler.ready) == [c]
    assert (a.block_ids, b.block_ids, c.block_ids) == ([0], [1], [2])
    assert scheduler.num_queued == 1 and scheduler.num_unfinished == 3
    assert plan(run_step(scheduler)) == [("a", 1), ("b", 1)]
    scheduler.finish(a, RequestStatus.FINISHED_STOPPED)
    assert plan(run_step(scheduler)) == [("b", 1), ("c", 1)]
    assert c.status is RequestStatus.RUNNING and not scheduler.ready
    scheduler.block_manager.check_invariants(scheduler.requests())


def test_a_queued_transfer_aborts_and_frees_its_blocks() -> None:
    scheduler = make_scheduler(max_seqs=1, block_size=4)
    _transferred(scheduler, "a", [1, 2, 3])
    b = _transferred(scheduler, "b", [4, 5, 6])
    free_before = scheduler.block_manager.num_free_blocks
    scheduler.finish(b, RequestStatus.FINISHED_ABORTED)
    assert not scheduler.ready and b.block_ids == []
    assert scheduler.block_manager.num_free_blocks == free_before + 1
    scheduler.block_manager.check_invariants(scheduler.requests())


def test_preemption_recomputes_newest_request() -> None:
    # 4 blocks of 2 tokens: two requests of 3 tokens each take 2 blocks; growing needs more.
    scheduler = make_scheduler(num_blocks=4, block_size=2, budget=16)
    a = make_request("a", [1, 2, 3], arrival_index=0)
    b = make_request("b", [4, 5, 6], arrival_index=1)
    scheduler.add(a)
    scheduler.add(b)
    run_step(scheduler)
    assert a.block_ids == [0, 1] and b.block_ids == [2, 3]
    run_step(scheduler)  # both have 4 tokens computed, 5 known: each needs a third block
    output = run_step(scheduler)
    assert [r.request_id for r in output.preempted] == ["b"]
    assert plan(output) == [("a", 1)]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and b.block_ids == []
    assert a.block_ids == [0, 1, 3]
    scheduler.block_manager.check_invariants(scheduler.requests())
    # b comes back once a finishes. Its first block (2) is still in the prefix cache; its
    # second was the first evicted (tail first) when a grew, so 3 of its 5 tokens are recomputed.
    scheduler.finish(a, RequestStatus.FINISHED_LENGTH)
    output = run_step(scheduler)
    assert plan(output) == [("b", 3)]
    assert b.block_ids[0] == 2 and b.num_cached_tokens == 2
    assert b.num_output_tokens == 3


def test_request_that_alone_does_not_fit_preempts_itself() -> None:
    scheduler = make_scheduler(num_blocks=2, block_size=2, budget=16)
    a = make_request("a", [1, 2, 3])
    scheduler.add(a)
    run_step(scheduler)
    run_step(scheduler)  # 4 computed, 5 known: needs a third block that does not exist
    output = run_step(scheduler)
    assert output.preempted == [a] and output.scheduled == []
    assert a.block_ids == [] and scheduler.waiting[0] is a


def test_abort_frees_blocks_at_once() -> None:
    scheduler = make_scheduler()
    a = make_request("a", list(range(10)))
    b = make_request("b", list(range(10)))
    scheduler.add(a)
    scheduler.add(b)
    run_step(scheduler)
    free_before = scheduler.block_manager.num_free_blocks
    scheduler.finish(a, RequestStatus.FINISHED_ABORTED)
    assert a.block_ids == [] and a.status is RequestStatus.FINISHED_ABORTED
    assert scheduler.block_manager.num_free_blocks == free_before + 3
    waiting = make_request("w", [1])
    scheduler.add(waiting)
    scheduler.finish(waiting, RequestStatus.FINISHED_ABORTED)
    assert list(scheduler.waiting) == []
    scheduler.block_manager.check_invariants(scheduler.requests())


def test_prefix_cache_hit_skips_computed_blocks() -> None:
    scheduler = make_scheduler(budget=64)
    a = make_request("a", list(range(10)))
    scheduler.add(a)
    run_step(scheduler)
    b = make_request("b", [*range(8), 42, 43])
    scheduler.add(b)
    output = run_step(scheduler)
    assert plan(output) == [("a", 1), ("b", 2)]
    assert b.block_ids[:2] == a.block_ids[:2]
    assert b.num_cached_tokens == 8


def test_static_policy_waits_for_the_whole_batch_and_reserves_a_padded_rectangle() -> None:
    scheduler = make_scheduler(num_blocks=16, block_size=4, max_seqs=3, budget=64, policy="static")
    prompts = {"a": [1, 2, 3, 4, 5], "b": [6, 7], "c": [8, 9, 10], "d": [11]}
    max_new = {"a": 2, "b": 6, "c": 1, "d": 1}
    requests = {
        name: make_request(name, tokens, max_new_tokens=max_new[name])
        for name, tokens in prompts.items()
    }
    for request in requests.values():
        scheduler.add(request)
    # Every member is left-padded to the longest prompt (5) and reserves the rectangle:
    # 5 + 6 (largest max_tokens) = 11 tokens = 3 blocks each.
    output = run_step(scheduler)
    assert plan(output) == [("a", 5), ("b", 5), ("c", 5)]
    assert requests["b"].token_ids[:5] == [STATIC_PAD_TOKEN_ID] * 3 + [6, 7]
    assert requests["b"].num_padding_tokens == 3 and requests["c"].num_padding_tokens == 2
    assert requests["b"].output_token_ids == [7]  # the token run_step sampled
    assert requests["a"].block_ids == [0, 1, 2]
    assert requests["b"].block_ids == [3, 4, 5]
    assert requests["c"].block_ids == [6, 7, 8]
    scheduler.finish(requests["a"], RequestStatus.FINISHED_LENGTH)
    scheduler.finish(requests["c"], RequestStatus.FINISHED_LENGTH)
    # d waits although a and c are done: b, the batch's longest member, still runs, and a and c
    # keep their rows (and blocks), computing padding, as a [batch, max_len] tensor would.
    assert plan(run_step(scheduler)) == [("a", 1), ("b", 1), ("c", 1)]
    assert requests["a"].block_ids == [0, 1, 2]
    assert requests["a"].status is RequestStatus.FINISHED_LENGTH
    scheduler.finish(requests["b"], RequestStatus.FINISHED_LENGTH)
    assert all(r.block_ids == [] for r in requests.values() if r.request_id != "d")
    assert scheduler.block_manager.num_free_blocks == 16 - 0
    assert plan(run_step(scheduler)) == [("d", 1)]
    assert len(requests["d"].block_ids) == 1


def test_static_batch_is_limited_by_the_padded_reservation() -> None:
    scheduler = make_scheduler(num_blocks=8, block_size=4, max_seqs=8, budget=64, policy="static")
    for name in "abcd":
        scheduler.add(make_request(name, [1] * 8, max_new_tokens=8))
    # Each member needs 16 tokens = 4 blocks: only two fit in 8 blocks.
    assert [r for r, _ in plan(run_step(scheduler))] == ["a", "b"]


def test_static_abort_frees_at_once_and_ends_a_batch_of_padding() -> None:
    scheduler = make_scheduler(num_blocks=16, block_size=4, max_seqs=4, budget=64, policy="static")
    a = make_request("a", [1, 2, 3], max_new_tokens=4)
    b = make_request("b", [4, 5, 6], max_new_tokens=4)
    for request in (a, b):
        scheduler.add(request)
    run_step(scheduler)
    scheduler.finish(a, RequestStatus.FINISHED_STOPPED)
    assert a.block_ids != [] and "a" in scheduler.padding_rows
    scheduler.finish(b, RequestStatus.FINISHED_ABORTED)
    assert a.block_ids == [] and b.block_ids == [] and not scheduler.running
    scheduler.block_manager.check_invariants(scheduler.requests())


def test_admission_leaves_a_watermark_while_others_run() -> None:
    scheduler = make_scheduler(num_blocks=10, block_size=4, budget=64, admission_watermark=0.2)
    a = make_request("a", list(range(20)))  # 5 blocks
    b = make_request("b", list(range(100, 112)))  # 3 blocks: would leave 2 free, the watermark
    c = make_request("c", list(range(200, 205)))  # 2 blocks: would leave 0 free
    for request in (a, b, c):
        scheduler.add(request)
    assert plan(run_step(scheduler)) == [("a", 20), ("b", 12)]
    assert [r.request_id for r in scheduler.waiting] == ["c"]
    # Alone, a request may take the whole pool: the watermark protects running requests only.
    alone = make_scheduler(num_blocks=5, block_size=4, budget=64, admission_watermark=0.5)
    alone.add(make_request("d", list(range(20))))
    assert plan(run_step(alone)) == [("d", 20)]
