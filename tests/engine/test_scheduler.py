"""Scheduler: token budget, chunked prefill mixed with decodes, preemption, abort, priorities."""

from __future__ import annotations

from collections.abc import Iterable

from nori.engine.block_manager import BlockManager
from nori.engine.config import SchedulerConfig
from nori.engine.request import Request, RequestStatus
from nori.engine.scheduler import Scheduler, SchedulerOutput
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


def test_only_interactive_decodes_cap_the_prompt_work_beside_them() -> None:
    """Batch decodes (priority > 0) are read whole at the end: beside them alone a prompt takes
    the whole budget; one interactive decode brings the cap back."""
    scheduler = make_scheduler(num_blocks=32, budget=16, prefill_budget_with_decodes=3)
    batch = make_request("batch", list(range(5)), priority=1000)
    scheduler.add(batch)
    assert plan(run_step(scheduler)) == [("batch", 5)]
    scheduler.add(make_request("long", list(range(100, 110)), priority=1000))
    assert plan(run_step(scheduler)) == [("batch", 1), ("long", 10)]
    chat = make_request("chat", list(range(200, 202)))
    scheduler.add(chat)
    assert plan(run_step(scheduler)) == [("batch", 1), ("long", 1), ("chat", 2)]
    scheduler.add(make_request("next", list(range(300, 310)), priority=1000))
    # chat now decodes: prompt work is capped again.
    assert plan(run_step(scheduler)) == [("chat", 1), ("batch", 1), ("long", 1), ("next", 3)]
    scheduler.block_manager.check_invariants(scheduler.requests())


def test_background_prompts_take_a_capped_share_of_steps_while_interactive_work_is_about() -> None:
    """A batch alone fills whole steps. Once an interactive request is about, batch prompts
    (priority > 0) carry at most `background_prefill_budget` tokens a step, in chunks, and the
    interactive prompt is not capped: it gets the rest of the step's budget. The cap outlasts
    the last interactive request by `background_cap_linger_steps` steps."""
    scheduler = make_scheduler(
        num_blocks=32, budget=24, background_prefill_budget=6, background_cap_linger_steps=2
    )
    early = make_request("early", list(range(500, 510)), priority=1000)
    scheduler.add(early)
    assert plan(run_step(scheduler)) == [("early", 10)]  # alone: uncapped
    first = make_request("first", list(range(10)), priority=1000)
    second = make_request("second", list(range(100, 104)), priority=1000)
    chat = make_request("chat", [300])
    for request in (first, second, chat):
        scheduler.add(request)
    # chat (1 token) goes first; batch prompts then get 6 tokens: 6 of first's.
    assert plan(run_step(scheduler)) == [("early", 1), ("chat", 1), ("first", 6)]
    # The running batch is in priority order: chat leads.
    assert [r.request_id for r in scheduler.running] == ["chat", "early", "first"]
    assert (early.block_ids, chat.block_ids, first.block_ids) == ([0, 1, 2], [3], [4, 5])
    chat_two = make_request("chat-two", list(range(200, 212)))
    scheduler.add(chat_two)
    # The rest of first's prompt (4) and 2 of second's ride along within the cap; chat-two
    # takes all 12 of its tokens.
    plan_three = plan(run_step(scheduler))
    assert plan_three == [("chat", 1), ("early", 1), ("first", 4), ("chat-two", 12), ("second", 2)]
    assert (first.block_ids, chat_two.block_ids, second.block_ids) == ([4, 5, 6], [7, 8, 9], [10])
    for request in (chat, chat_two):
        scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
    scheduler.add(make_request("late", list(range(600, 640)), priority=1000))
    # No interactive request is left: the cap lingers for 2 steps, then lifts.
    assert plan(run_step(scheduler)) == [("early", 1), ("first", 1), ("second", 2), ("late", 4)]
    assert plan(run_step(scheduler)) == [("early", 1), ("first", 1), ("second", 1), ("late", 6)]
    assert plan(run_step(scheduler)) == [("early", 1), ("first", 1), ("second", 1), ("late", 21)]
    scheduler.block_manager.check_invariants(scheduler.requests())


def test_without_a_background_budget_batch_prompts_fill_the_step() -> None:
    scheduler = make_scheduler(num_blocks=32, budget=16)
    scheduler.add(make_request("first", list(range(10)), priority=1000))
    scheduler.add(make_request("second", list(range(100, 104)), priority=1000))
    assert plan(run_step(scheduler)) == [("first", 10), ("second", 4)]


def test_sequence_limit_keeps_others_waiting() -> None:
    scheduler = make_scheduler(max_seqs=2)
    for name in "abc":
        scheduler.add(make_request(name, [1, 2, 3]))
    assert plan(run_step(scheduler)) == [("a", 3), ("b", 3)]
    assert [r.request_id for r in scheduler.waiting] == ["c"]


def _transferred(scheduler: Scheduler, name: str, prompt: list[int], priority: int = 0) -> Request:
    """A request whose prompt K/V arrived from a prefill worker with its first token, as the
    engine's add_request(remote_kv=KVFromRemote()) + finish_kv_transfer leave it: blocks held,
    then activated."""
    request = make_request(name, prompt, priority=priority)
    assert scheduler.block_manager.allocate(request, len(prompt) + 1)
    request.num_computed_tokens = len(prompt)
    request.append_token(7)
    scheduler.hold(request, RequestStatus.WAITING_FOR_KV)
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


# ------------------------------------------------------------------------------- priorities


def ids(requests: Iterable[Request]) -> list[str]:
    return [request.request_id for request in requests]


def test_waiting_requests_are_served_by_priority_then_arrival() -> None:
    scheduler = make_scheduler(num_blocks=2, block_size=2, max_seqs=1, budget=16)
    p = make_request("p", [1, 2, 3], priority=5)
    scheduler.add(p)
    assert plan(run_step(scheduler)) == [("p", 3)]
    for name, priority in [("z", 1000), ("x", 0), ("y", 5), ("w", 0)]:
        scheduler.add(make_request(name, [9], priority=priority))
    # Ahead of less urgent requests (a larger value), never ahead of equal ones.
    assert ids(scheduler.waiting) == ["x", "w", "y", "z"]
    run_step(scheduler)  # p: 4 tokens computed, 5 known; the one row is taken
    output = run_step(scheduler)  # p needs a third block: nobody less important holds one
    assert output.preempted == [p] and p.block_ids == []
    # A preempted request resumes ahead of its equals, behind more urgent requests.
    assert ids(scheduler.waiting) == ["x", "w", "p", "y", "z"]
    assert plan(run_step(scheduler)) == [("x", 1)]


def test_arrived_kv_joins_the_batch_by_priority() -> None:
    scheduler = make_scheduler(max_seqs=1, block_size=4)
    a = _transferred(scheduler, "a", [1, 2, 3])
    _transferred(scheduler, "b", [4, 5, 6], priority=1000)
    c = _transferred(scheduler, "c", [8, 9, 10])
    assert ids(scheduler.ready) == ["c", "b"]
    scheduler.finish(a, RequestStatus.FINISHED_STOPPED)
    assert plan(run_step(scheduler)) == [("c", 1)]
    assert c.status is RequestStatus.RUNNING and ids(scheduler.ready) == ["b"]


def test_a_dry_pool_preempts_the_least_important_request_not_the_newest() -> None:
    scheduler = make_scheduler(num_blocks=6, block_size=2, budget=16)
    b = make_request("b", [4, 5], priority=1000)
    scheduler.add(b)
    assert plan(run_step(scheduler)) == [("b", 2)]
    a = make_request("a", [1, 2])
    c = make_request("c", [7, 8, 9])
    scheduler.add(a)
    scheduler.add(c)
    assert plan(run_step(scheduler)) == [("b", 1), ("a", 2), ("c", 3)]
    # The running batch is kept in priority order: its last request is the victim.
    assert ids(scheduler.running) == ["a", "c", "b"]
    assert (a.block_ids, b.block_ids, c.block_ids) == ([2], [0, 1], [3, 4])
    assert plan(run_step(scheduler)) == [("a", 1), ("c", 1), ("b", 1)]  # a took block 5
    # c, the newest, needs a third block: b, the oldest but least important, gives its blocks
    # back (tail first), and c takes b's tail block.
    output = run_step(scheduler)
    assert output.preempted == [b] and plan(output) == [("a", 1), ("c", 1)]
    assert (a.block_ids, b.block_ids, c.block_ids) == ([2, 5], [], [3, 4, 1])
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
    scheduler.block_manager.check_invariants(scheduler.requests())


def test_an_urgent_request_preempts_the_fewest_less_important_ones() -> None:
    scheduler = make_scheduler(num_blocks=8, block_size=8, budget=128)
    x = make_request("x", list(range(9)), priority=500)
    y = make_request("y", list(range(100, 109)), priority=1000)
    z = make_request("z", list(range(200, 209)), priority=1000)
    for request in (x, y, z):
        scheduler.add(request)
    assert plan(run_step(scheduler)) == [("x", 9), ("y", 9), ("z", 9)]
    assert (x.block_ids, y.block_ids, z.block_ids) == ([0, 1], [2, 3], [4, 5])
    # 9 blocks: more than all less important requests together free. Nobody is preempted.
    big = make_request("big", list(range(300, 372)))
    scheduler.add(big)
    output = run_step(scheduler)
    assert output.preempted == [] and ids(scheduler.waiting) == ["big"]
    scheduler.finish(big, RequestStatus.FINISHED_ABORTED)
    # An equal never preempts: e (3 blocks, 2 free) waits.
    e = make_request("e", list(range(400, 420)), priority=1000)
    scheduler.add(e)
    output = run_step(scheduler)
    assert output.preempted == [] and plan(output) == [("x", 1), ("y", 1), ("z", 1)]
    # i needs 3 blocks, one more than is free: z alone (the newest of the least important)
    # frees enough. It had been scheduled for a decode in this very step: it no longer runs.
    i = make_request("i", list(range(500, 520)))
    scheduler.add(i)
    output = run_step(scheduler)
    assert output.preempted == [z]
    assert plan(output) == [("x", 1), ("y", 1), ("i", 20)]
    assert (i.block_ids, y.block_ids, z.block_ids) == ([6, 7, 5], [2, 3], [])
    # z waits ahead of its equal e; neither comes back in the step that preempted z.
    assert ids(scheduler.waiting) == ["z", "e"]
    assert z.num_preemptions == 1 and scheduler.num_preemptions == 1
    scheduler.block_manager.check_invariants(scheduler.requests())
    # z's first block is still cached: when it runs again, only the rest is recomputed.
    for request in (x, y, i):
        scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
    output = run_step(scheduler)
    assert plan(output)[0] == ("z", 4) and z.block_ids[0] == 4 and z.num_cached_tokens == 8


def test_shared_blocks_free_nothing_until_every_holder_is_preempted() -> None:
    scheduler = make_scheduler(num_blocks=6, block_size=4, budget=64)
    shared = list(range(8))
    a = make_request("a", [*shared, 50, 51], priority=1000)
    scheduler.add(a)
    run_step(scheduler)
    b = make_request("b", [*shared, 60, 61], priority=1000)
    scheduler.add(b)
    run_step(scheduler)
    assert (a.block_ids, b.block_ids) == ([0, 1, 2], [0, 1, 3])
    manager = scheduler.block_manager
    assert list(manager.blocks_freed_by([b, a])) == [1, 4]
    assert list(manager.blocks_freed_by([b, a], keep={0})) == [1, 3]
    # 4 blocks for u, 2 free: preempting b frees one (block 3), so a goes too.
    u = make_request("u", list(range(100, 116)))
    scheduler.add(u)
    output = run_step(scheduler)
    assert output.preempted == [b, a] and plan(output) == [("u", 16)]
    manager.check_invariants(scheduler.requests())


def test_the_watermark_counts_less_important_blocks_as_room() -> None:
    """Admission leaves blocks free for the running requests to grow into; when the pool runs
    dry the least important request is preempted, whoever grows, so its blocks are room too."""
    scheduler = make_scheduler(num_blocks=10, block_size=4, budget=64, admission_watermark=0.2)
    b = make_request("b", list(range(20)), priority=1000)
    scheduler.add(b)
    run_step(scheduler)
    late = make_request("late", list(range(100, 116)), priority=1000)
    urgent = make_request("urgent", list(range(200, 216)))
    scheduler.add(late)
    scheduler.add(urgent)
    # b grows into block 5; 4 free are exactly what either needs, leaving none of the 2-block
    # watermark. late waits for it; urgent goes, and takes no block of b yet.
    output = run_step(scheduler)
    assert plan(output) == [("b", 1), ("urgent", 16)] and output.preempted == []
    assert urgent.block_ids == [6, 7, 8, 9] and ids(scheduler.waiting) == ["late"]
