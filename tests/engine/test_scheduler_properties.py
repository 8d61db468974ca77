"""Random add/step/abort/finish sequences keep the block manager's invariants, with priorities
too."""

from __future__ import annotations

from collections.abc import Iterable

from hypothesis import given, settings
from hypothesis import strategies as st

from nori.engine.request import Request, RequestStatus
from nori.engine.scheduler import Scheduler
from tests.engine.helpers import make_request
from tests.engine.test_scheduler import make_scheduler, run_step

actions = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.lists(st.integers(0, 5), min_size=1, max_size=40)),
        st.tuples(st.just("step"), st.integers(0, 9)),
        st.tuples(st.just("abort"), st.integers(0, 50)),
        st.tuples(st.just("finish"), st.integers(0, 50)),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(
    actions=actions,
    num_blocks=st.integers(4, 24),
    block_size=st.sampled_from([1, 2, 4]),
    budget=st.integers(1, 32),
    max_seqs=st.integers(1, 6),
    caching=st.booleans(),
    prefill_cap=st.one_of(st.none(), st.integers(1, 8)),
)
def test_random_traffic_keeps_invariants(
    actions: list[tuple[str, object]],
    num_blocks: int,
    block_size: int,
    budget: int,
    max_seqs: int,
    caching: bool,
    prefill_cap: int | None,
) -> None:
    scheduler = make_scheduler(
        num_blocks,
        block_size,
        max_seqs,
        budget,
        prefill_budget_with_decodes=prefill_cap,
    )
    manager = scheduler.block_manager
    manager.enable_prefix_caching = caching
    known = []
    for kind, value in actions:
        if kind == "add":
            # Never larger than the pool, else it could never run (the engine rejects those).
            tokens = list(value)[: max(1, (num_blocks - 1) * block_size)]  # type: ignore[call-overload]
            request = make_request(
                f"r{len(known)}", tokens, arrival_index=len(known), max_new_tokens=len(tokens) % 7
            )
            known.append(request)
            scheduler.add(request)
        elif kind == "step":
            # The scheduler caps prompt work in steps that start with decodes to run.
            decoding = any(r.num_uncomputed_tokens == 1 for r in scheduler.running)
            output = run_step(scheduler, sampled_token=int(value))  # type: ignore[call-overload]
            assert output.num_batched_tokens <= budget
            prompt_tokens = sum(s.num_new_tokens for s in output.scheduled if s.num_new_tokens > 1)
            if prefill_cap is not None and decoding:
                assert prompt_tokens <= prefill_cap
            assert len(scheduler.running) <= max_seqs
            for item in output.scheduled:
                covered = len(item.request.block_ids) * block_size
                assert covered >= item.request.num_computed_tokens
        elif known:
            request = known[int(value) % len(known)]  # type: ignore[call-overload]
            if not request.status.is_finished:
                status = (
                    RequestStatus.FINISHED_ABORTED
                    if kind == "abort"
                    else RequestStatus.FINISHED_STOPPED
                )
                scheduler.finish(request, status)
                assert request.block_ids == []
        manager.check_invariants(scheduler.requests())
    for request in list(scheduler.requests()):
        scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
    manager.check_invariants([])
    usage = manager.usage()
    assert usage.in_use == 0 and usage.free + usage.cached == num_blocks


# Several steps at a time, so that requests grow into a full pool and preempt.
priority_actions = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.lists(st.integers(0, 30), min_size=1, max_size=40),
            st.sampled_from([0, 5, 1000]),
        ),
        st.tuples(
            st.just("reserve"),
            st.lists(st.integers(0, 30), min_size=1, max_size=20),
            st.sampled_from([0, 5, 1000]),
        ),
        st.tuples(st.just("activate"), st.integers(0, 50), st.just(0)),
        st.tuples(st.just("step"), st.integers(0, 9), st.integers(1, 8)),
        st.tuples(st.just("finish"), st.integers(0, 50), st.just(0)),
    ),
    min_size=10,
    max_size=60,
)


def _sorted_by_priority(requests: Iterable[Request]) -> bool:
    priorities = [request.priority for request in requests]
    return priorities == sorted(priorities)


def _reserve(scheduler: Scheduler, request: Request) -> bool:
    """What LLMEngine.add_request(remote_kv=KVFromRemote()) does: blocks for the request's K/V,
    by preempting less urgent running requests when the pool has too few; then it waits for the
    K/V (WAITING_FOR_KV)."""
    manager = scheduler.block_manager
    if not manager.allocate(request, request.num_tokens):
        victims = scheduler.preempt_for(request, request.num_tokens)
        assert all(victim.priority > request.priority for victim in victims)
        # Enough room, or nobody preempted.
        assert manager.allocate(request, request.num_tokens) == bool(victims)
        if not victims:
            return False
    request.num_computed_tokens = request.num_tokens
    request.append_token(7)  # the first token, sampled by the prefill side
    scheduler.hold(request, RequestStatus.WAITING_FOR_KV)
    return True


@settings(max_examples=200, deadline=None)
@given(
    actions=priority_actions,
    num_blocks=st.integers(4, 24),
    block_size=st.sampled_from([1, 2, 4]),
    budget=st.integers(1, 32),
    max_seqs=st.integers(1, 6),
    watermark=st.sampled_from([0.0, 0.2]),
)
def test_random_traffic_with_priorities_keeps_invariants(
    actions: list[tuple[str, object, int]],
    num_blocks: int,
    block_size: int,
    budget: int,
    max_seqs: int,
    watermark: float,
) -> None:
    """Mixed priorities, preemption for the more urgent (admission and reservations, as the
    engine's add_request with KVFromRemote does it): the pool's bookkeeping holds, every queue stays in
    priority order, and a reservation only ever preempts requests less urgent than itself."""
    scheduler = make_scheduler(
        num_blocks, block_size, max_seqs, budget, admission_watermark=watermark
    )
    manager = scheduler.block_manager
    known: list[Request] = []
    reserved: list[Request] = []
    # `priority`: a new request's, or how many steps to take.
    for kind, value, priority in actions:
        if kind in ("add", "reserve"):
            tokens = list(value)[: max(1, (num_blocks - 1) * block_size)]  # type: ignore[call-overload]
            request = make_request(f"r{len(known)}", tokens, len(known), priority=priority)
            if kind == "add":
                scheduler.add(request)
                known.append(request)
            elif _reserve(scheduler, request):
                known.append(request)
                reserved.append(request)
        elif kind == "activate" and reserved:
            request = reserved.pop(int(value) % len(reserved))  # type: ignore[call-overload]
            if request.status is RequestStatus.WAITING_FOR_KV:
                scheduler.activate(request.request_id)
        elif kind == "step":
            for _ in range(priority):  # the number of steps
                output = run_step(scheduler, sampled_token=int(value))  # type: ignore[call-overload]
                assert output.num_batched_tokens <= budget
                preempted = {id(request) for request in output.preempted}
                assert not {id(item.request) for item in output.scheduled} & preempted
                for item in output.scheduled:
                    covered = len(item.request.block_ids) * block_size
                    assert covered >= item.request.num_computed_tokens
        elif kind == "finish" and known:
            request = known[int(value) % len(known)]  # type: ignore[call-overload]
            if not request.status.is_finished:
                scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
                assert request.block_ids == []
        assert len(scheduler.running) <= max_seqs
        for queue in (scheduler.waiting, scheduler.running, scheduler.ready):
            assert _sorted_by_priority(queue)
        manager.check_invariants(scheduler.requests())
    for request in list(scheduler.requests()):
        scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
    manager.check_invariants([])
