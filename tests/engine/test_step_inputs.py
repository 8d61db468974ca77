"""`StepInputs` equals the oracle builder over random traffic: prompts in chunks, decodes,
verifications with accepted and rejected drafts, prompt logprobs, preemption, aborts; and a pure
decode step writes into the same buffers without making new ones (no aten call of its build
returns a tensor of new storage)."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from nori.engine.request import Request, RequestStatus
from nori.engine.scheduler import Scheduler, SchedulerOutput
from nori.engine.step_inputs import BatchInputs, StepInputs
from tests.engine.batch_inputs_oracle import build_batch_inputs
from tests.engine.helpers import make_request
from tests.engine.test_scheduler import make_scheduler

CPU = torch.device("cpu")


def _assert_equal(got: BatchInputs, want: BatchInputs) -> None:
    for name in ("input_ids", "positions", "logits_indices"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    g, w = got.attention, want.attention
    for name in ("slot_mapping", "seq_lens", "query_start_loc"):
        assert torch.equal(getattr(g, name), getattr(w, name)), name
    width = w.block_tables.shape[1]
    assert torch.equal(g.block_tables[:, :width], w.block_tables)
    assert not g.block_tables[:, width:].any(), "a table row is not zero past its blocks"
    assert (g.num_decodes, g.num_verifies, g.num_verify_end_row, g.max_seq_len) == (
        w.num_decodes,
        w.num_verifies,
        w.num_verify_end_row,
        w.max_seq_len,
    )
    assert [(r.request, r.first_row, r.target_token_ids) for r in got.prompt_logprob_rows] == [
        (r.request, r.first_row, r.target_token_ids) for r in want.prompt_logprob_rows
    ]


def _step(scheduler: Scheduler, rng: random.Random, drafts: int) -> SchedulerOutput:
    """Schedules with up to `drafts` drafts per decode, proposes them, and returns the output."""
    spec = {r.request_id: drafts for r in scheduler.running if r.num_uncomputed_tokens == 1}
    output = scheduler.schedule(spec)
    for item in output.scheduled:
        item.request.spec_token_ids = [rng.randrange(50) for _ in range(item.num_spec_tokens)]
    return output


def _finish_step(scheduler: Scheduler, output: SchedulerOutput, rng: random.Random) -> None:
    """Accepts some drafts of each verification, then samples one token per sampling request."""
    rejected = {}
    for item in output.scheduled:
        request = item.request
        if item.num_spec_tokens:
            accepted = rng.randint(0, item.num_spec_tokens)
            request.token_ids.extend(request.spec_token_ids[:accepted])
            rejected[request.request_id] = item.num_spec_tokens - accepted
    samplers = [s.request for s in output.scheduled if s.samples]
    scheduler.update(output, rejected)
    for item in output.scheduled:
        item.request.spec_token_ids = []
    for request in samplers:
        request.append_token(rng.randrange(50))


actions = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 40), st.booleans()),
        st.tuples(st.just("steps"), st.integers(1, 6), st.booleans()),
        st.tuples(st.just("abort"), st.integers(0, 50), st.just(False)),
    ),
    max_size=50,
)


@settings(max_examples=150, deadline=None)
@given(
    actions=actions,
    num_blocks=st.integers(6, 40),
    block_size=st.sampled_from([1, 2, 4, 16]),
    budget=st.integers(4, 48),
    max_seqs=st.integers(1, 6),
    seed=st.integers(0, 1000),
)
def test_step_inputs_equal_the_oracle_over_random_traffic(
    actions: list[tuple[str, int, bool]],
    num_blocks: int,
    block_size: int,
    budget: int,
    max_seqs: int,
    seed: int,
) -> None:
    rng = random.Random(seed)
    scheduler = make_scheduler(num_blocks, block_size, max_seqs, budget)
    # Deliberately small: the buffers grow as the traffic needs.
    inputs = StepInputs(1, 2, 1, CPU)
    known: list[Request] = []
    for kind, value, flag in actions:
        if kind == "add":
            length = min(value, (num_blocks - 2) * block_size)
            tokens = [rng.randrange(50) for _ in range(max(length, 1))]
            request = make_request(f"r{len(known)}", tokens, arrival_index=len(known))
            if flag:
                request.prompt_logprobs = [None]
            known.append(request)
            scheduler.add(request)
        elif kind == "steps":
            for _ in range(value):
                output = _step(scheduler, rng, drafts=rng.randint(0, 3) if flag else 0)
                if output.scheduled:
                    want = build_batch_inputs(output, block_size, CPU)
                    _assert_equal(inputs.build(output, block_size), want)
                _finish_step(scheduler, output, rng)
        elif known:
            request = known[value % len(known)]
            if not request.status.is_finished:
                scheduler.finish(request, RequestStatus.FINISHED_ABORTED)


def test_a_decode_step_reuses_the_buffers() -> None:
    scheduler = make_scheduler(num_blocks=32, block_size=4, max_seqs=4, budget=64)
    for index in range(3):
        scheduler.add(make_request(f"r{index}", list(range(5 + index))))
    inputs = StepInputs(4, 64, 8, CPU)
    rng = random.Random(0)
    output = _step(scheduler, rng, 0)
    first = inputs.build(output, 4)
    _finish_step(scheduler, output, rng)
    output = _step(scheduler, rng, 0)
    second = inputs.build(output, 4)
    assert second.attention.num_decodes == 3
    pairs = [
        (first.input_ids, second.input_ids),
        (first.positions, second.positions),
        (first.attention.slot_mapping, second.attention.slot_mapping),
        (first.attention.block_tables, second.attention.block_tables),
        (first.attention.seq_lens, second.attention.seq_lens),
    ]
    for before, after in pairs:
        assert before.data_ptr() == after.data_ptr()
    assert second.attention.block_tables.stride(0) == 8
    _assert_equal(second, build_batch_inputs(output, 4, CPU))


class _NewStorage(TorchDispatchMode):
    """Counts every aten call, and apart those that make a tensor: a result whose storage none
    of the tensor arguments has (factories, copies out of place, ...), or torch.tensor's lift
    (its data is made before the call)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()
        self.allocations: Counter[str] = Counter()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        result = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        self.calls[name] += 1
        given = {_storage(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        results = [t for t in tree_leaves(result) if isinstance(t, torch.Tensor)]
        if name.startswith("lift_fresh") or any(_storage(t) not in given for t in results):
            self.allocations[name] += 1
        return result


def _storage(tensor: torch.Tensor) -> int:
    return int(tensor.untyped_storage()._cdata)


# "meta" stands in for a device: its buffers are twins apart from the host ones, as on CUDA.
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_decode_step_builds_its_inputs_without_a_new_tensor(device: str) -> None:
    scheduler = make_scheduler(num_blocks=32, block_size=4, max_seqs=4, budget=64)
    for index in range(3):
        scheduler.add(make_request(f"r{index}", list(range(5 + index))))
    inputs = StepInputs(4, 64, 8, torch.device(device))
    rng = random.Random(0)
    for _ in range(2):  # the prompts, then a decode step: every buffer and store row exists
        output = _step(scheduler, rng, 0)
        inputs.build(output, 4)
        _finish_step(scheduler, output, rng)
    for _ in range(4):  # decodes within a block and into a new one
        output = _step(scheduler, rng, 0)
        with _NewStorage() as counted:
            built = inputs.build(output, 4)
        assert built.attention.num_decodes == 3
        assert counted.calls["slice"] >= 5, counted.calls  # the sent rows: views, counted
        assert not counted.allocations, f"new tensors: {dict(counted.allocations)}"
        _finish_step(scheduler, output, rng)


def test_a_table_trimmed_and_grown_again_is_rewritten() -> None:
    """Rejected drafts give their blocks back (to the free queue's back); the next verification
    takes other blocks at the same table positions."""
    scheduler = make_scheduler(num_blocks=32, block_size=1, max_seqs=1, budget=16)
    request = make_request("r", [1, 2, 3])
    scheduler.add(request)
    inputs = StepInputs(1, 16, 4, CPU)
    rng = random.Random(0)
    _finish_step(scheduler, _step(scheduler, rng, 0), rng)
    tables = []
    for _ in range(2):
        output = _step(scheduler, rng, 3)
        assert output.scheduled[0].num_spec_tokens == 3
        got = inputs.build(output, 1)
        _assert_equal(got, build_batch_inputs(output, 1, CPU))
        tables.append(got.attention.block_tables[0, :8].tolist())
        scheduler.update(output, {"r": 3})  # every draft rejected
        request.spec_token_ids = []
        request.append_token(5)
    assert tables[0][4:7] != tables[1][4:7]
