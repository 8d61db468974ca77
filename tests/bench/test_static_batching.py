"""The static-batching baseline (bench/static_batching.py): whole batches, padded rectangles,
pad rows that never reach the engine, and the same tokens as continuous batching."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from nori.bench.static_batching import PAD_TOKEN_ID, StaticBatchScheduler
from nori.engine.block_manager import BlockManager
from nori.engine.config import EngineConfig, SchedulerConfig
from nori.engine.engine import LLMEngine
from nori.engine.request import RequestStatus
from nori.models.init_checkpoint import init_checkpoint
from nori.sampling.params import SamplingParams
from tests.engine.helpers import make_request
from tests.engine.test_scheduler import plan, run_step
from tests.engine.test_scheduler_properties import actions


def make_static(
    num_blocks: int = 16, block_size: int = 4, max_seqs: int = 8, budget: int = 64
) -> StaticBatchScheduler:
    config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget)
    return StaticBatchScheduler(config, BlockManager(num_blocks, block_size, False))


def test_a_batch_waits_for_its_longest_member_in_a_padded_rectangle() -> None:
    scheduler = make_static(num_blocks=16, block_size=4, max_seqs=3)
    prompts = {"a": [1, 2, 3, 4, 5], "b": [6, 7], "c": [8, 9, 10], "d": [11]}
    max_new = {"a": 2, "b": 6, "c": 1, "d": 1}
    requests = {
        name: make_request(name, tokens, max_new_tokens=max_new[name])
        for name, tokens in prompts.items()
    }
    for request in requests.values():
        scheduler.add(request)
    # Every row is as long as the longest prompt (5): b and c compute their left padding in a
    # pad row of their own, and each member reserves 5 + 6 (the largest max_tokens) tokens.
    output = run_step(scheduler)
    assert plan(output) == [("a", 5), ("b/pad", 3), ("b", 2), ("c/pad", 2), ("c", 3)]
    # The members sampled (run_step appends a 7 to each), the pad rows did not.
    assert all(requests[name].output_token_ids == [7] for name in "abc")
    assert scheduler.pad_rows["b/pad"].token_ids == [PAD_TOKEN_ID] * 4
    assert requests["a"].block_ids == [0, 1, 2]
    assert requests["b"].block_ids == [3, 4] and scheduler.pad_rows["b/pad"].block_ids == [5]
    assert requests["c"].block_ids == [6, 7, 8] and scheduler.pad_rows["c/pad"].block_ids == [9]
    scheduler.finish(requests["a"], RequestStatus.FINISHED_LENGTH)
    scheduler.finish(requests["c"], RequestStatus.FINISHED_LENGTH)
    # d waits although a and c are done: b, the batch's longest member, still runs, and a and c
    # keep their rows (and blocks), computing padding, as a [batch, max_len] tensor would.
    assert plan(run_step(scheduler)) == [("a/row", 1), ("b", 1), ("c/row", 1)]
    assert requests["a"].block_ids == [] and scheduler.pad_rows["a/row"].block_ids == [0, 1, 2]
    assert requests["a"].status is RequestStatus.FINISHED_LENGTH
    scheduler.block_manager.check_invariants(scheduler.requests())
    scheduler.finish(requests["b"], RequestStatus.FINISHED_LENGTH)
    assert not scheduler.running and not scheduler.pad_rows
    assert scheduler.block_manager.num_free_blocks == 16
    assert plan(run_step(scheduler)) == [("d", 1)]
    assert len(requests["d"].block_ids) == 1


def test_a_batch_is_limited_by_the_padded_reservation() -> None:
    scheduler = make_static(num_blocks=8, block_size=4, max_seqs=8)
    for name in "abcd":
        scheduler.add(make_request(name, [1] * 8, max_new_tokens=8))
    # Each member needs 16 tokens = 4 blocks: only two fit in 8 blocks.
    assert [r for r, _ in plan(run_step(scheduler))] == ["a", "b"]


def test_an_abort_frees_at_once_and_ends_a_batch_of_padding() -> None:
    scheduler = make_static(num_blocks=16, block_size=4, max_seqs=4)
    a = make_request("a", [1, 2, 3], max_new_tokens=4)
    b = make_request("b", [4, 5, 6], max_new_tokens=4)
    for request in (a, b):
        scheduler.add(request)
    run_step(scheduler)
    scheduler.finish(a, RequestStatus.FINISHED_STOPPED)
    assert a.block_ids == [] and scheduler.pad_rows["a/row"].block_ids != []
    scheduler.finish(b, RequestStatus.FINISHED_ABORTED)
    assert b.block_ids == [] and not scheduler.running and not scheduler.pad_rows
    scheduler.block_manager.check_invariants(scheduler.requests())
    assert scheduler.block_manager.num_free_blocks == 16


@settings(max_examples=100, deadline=None)
@given(
    actions=actions,
    num_blocks=st.integers(4, 24),
    block_size=st.sampled_from([1, 2, 4]),
    budget=st.integers(1, 32),
    max_seqs=st.integers(1, 6),
)
def test_random_traffic_keeps_invariants(
    actions: list[tuple[str, object]], num_blocks: int, block_size: int, budget: int, max_seqs: int
) -> None:
    scheduler = make_static(num_blocks, block_size, max_seqs, budget)
    manager = scheduler.block_manager
    known = []
    for kind, value in actions:
        if kind == "add":
            tokens = list(value)[: max(1, (num_blocks - 1) * block_size)]  # type: ignore[call-overload]
            request = make_request(
                f"r{len(known)}", tokens, arrival_index=len(known), max_new_tokens=len(tokens) % 7
            )
            known.append(request)
            scheduler.add(request)
        elif kind == "step":
            output = run_step(scheduler, sampled_token=int(value))  # type: ignore[call-overload]
            assert output.num_batched_tokens <= budget
            assert len(scheduler.running) - len(scheduler.pad_rows) <= max_seqs
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
        if request.request_id not in scheduler.pad_rows:
            scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
    assert not scheduler.pad_rows and not scheduler.running
    manager.check_invariants([])
    assert manager.usage().in_use == 0


def generate(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    for index, (prompt, param) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(index), prompt, param)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    return {int(request_id): output for request_id, output in finished.items()}


def static_engine(checkpoint: Path, **settings: object) -> LLMEngine:
    config = EngineConfig(
        model=str(checkpoint), dtype="float32", enable_prefix_caching=False, **settings
    )  # type: ignore[arg-type]
    return LLMEngine(config, scheduler_class=StaticBatchScheduler)


def test_static_batching_gives_the_same_tokens_and_frees_everything(tmp_path: Path) -> None:
    init_checkpoint(tmp_path, "tiny", seed=4)
    prompts = [[5 + i] * (3 + 4 * i) for i in range(6)]
    params = [
        SamplingParams(max_tokens=2 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(6)
    ]
    settings = {"num_kv_blocks": 64, "block_size": 4}
    continuous = LLMEngine(EngineConfig(model=str(tmp_path), dtype="float32", **settings))  # type: ignore[arg-type]
    static = static_engine(tmp_path, max_num_seqs=4, **settings)
    expected = generate(continuous, prompts, params)
    got = generate(static, prompts, params)
    assert [got[i].token_ids for i in range(6)] == [expected[i].token_ids for i in range(6)]
    assert [len(got[i].token_ids) for i in range(6)] == [p.max_tokens for p in params]
    static.kv_cache.check_invariants()
    assert static.load().num_free_blocks == 64 and static.load().num_running == 0


def test_a_padded_member_still_grows_to_max_model_len(tmp_path: Path) -> None:
    """The 4-token prompt's row is 20 long: the member still may grow to 24 tokens."""
    init_checkpoint(tmp_path, "tiny", seed=2)
    engine = static_engine(tmp_path, num_kv_blocks=256, block_size=8, max_model_len=24)
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    outputs = generate(engine, [[5] * 20, [6] * 4], [params, params])
    assert [len(outputs[i].token_ids) for i in range(2)] == [4, 20]
    assert all(outputs[i].finish_reason == "length" for i in range(2))
    assert engine.load().num_free_blocks == 256
