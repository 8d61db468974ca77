"""What the prefill and decode servicers share: engine calls from gRPC handlers, each request's
output stream, the KV block buffers of a transfer, call admission and GetStats' figures.

The KV cache is [layers, 2, num_blocks, block_size, kv_heads, head_dim] (plus scales for an 8-bit
cache: `KVCache.tensors`); a run of consecutive block ids in one tensor, layer and half is one
region, sliced the same way from the receiver's cache and the sender's exported copies."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, TypeVar

import grpc
import torch

from nori.engine.outputs import StepOutput
from nori.rpc.convert import logprobs_to_proto, params_from_proto
from nori.sampling.params import SamplingParams
from nori.v1 import common_pb2
from nori.worker.engine_core import EngineCore
from nori.worker.request_telemetry import CallRecord, WorkerTelemetry

T = TypeVar("T")


async def call_engine(
    engine: EngineCore,
    context: grpc.aio.ServicerContext,
    function: Callable[..., T],
    *args: Any,
    **kwargs: Any,
) -> T:
    """Runs `function(engine, *args, **kwargs)` in the engine loop. The engine raises ValueError
    only for input it can never serve (the caller's error)."""
    try:
        return await engine.call(function, *args, **kwargs)
    except ValueError as error:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
    raise AssertionError("unreachable: context.abort raises")


async def next_output(queue: asyncio.Queue[StepOutput]) -> StepOutput:
    """The request's next output, merged with every further one already waiting (a slow
    consumer gets one delta for the steps it missed)."""
    output = await queue.get()
    while not output.finished and not queue.empty():
        output = output.followed_by(queue.get_nowait())
    return output


async def next_output_of(queue: asyncio.Queue[StepOutput], num_tokens: int) -> StepOutput:
    """The next outputs merged until they hold `num_tokens` new tokens, or the last is in."""
    output = await next_output(queue)
    while not output.finished and len(output.new_token_ids) < num_tokens:
        output = output.followed_by(await next_output(queue))
    return output


class OutputQueue(asyncio.Queue[StepOutput]):
    def __init__(self) -> None:
        super().__init__()
        self.finished = asyncio.Event()


async def next_output_coalesced(queue: OutputQueue, interval_s: float) -> StepOutput:
    """The next output merged with every further one for `interval_s`, or until it finishes;
    the consumer sleeps meanwhile (one wake-up per interval, not per step)."""
    output = await next_output(queue)
    if not output.finished:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(interval_s):
                await queue.finished.wait()
        while not output.finished and not queue.empty():
            output = output.followed_by(queue.get_nowait())
    return output


class OutputStreams:
    """One queue per open request, filled on the event loop; outputs nobody waits for drop."""

    def __init__(self) -> None:
        self._queues: dict[str, OutputQueue] = {}

    def open(self, request_id: str) -> OutputQueue:
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        queue = OutputQueue()
        self._queues[request_id] = queue
        return queue

    def close(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def dispatch(self, outputs: list[StepOutput]) -> None:
        for output in outputs:
            queue = self._queues.get(output.request_id)
            if queue is not None:
                queue.put_nowait(output)
                if output.finished:
                    queue.finished.set()

    def __len__(self) -> int:
        return len(self._queues)


def delta_from_output(output: StepOutput) -> common_pb2.TokenDelta:
    delta = common_pb2.TokenDelta(
        token_ids=output.new_token_ids,
        text=output.new_text,
        finished=output.finished,
        finish_reason=output.finish_reason or "",
        num_cached_tokens=output.num_cached_tokens,
    )
    if isinstance(output.stop_reason, str):
        delta.stop_string = output.stop_reason
    elif isinstance(output.stop_reason, int):
        delta.stop_token_id = output.stop_reason
    if output.logprobs is not None and output.new_token_ids:
        new = output.logprobs[-len(output.new_token_ids) :]
        delta.logprobs.extend(logprobs_to_proto(entry) for entry in new)
    if output.prompt_logprobs is not None and len(output.new_token_ids) == len(output.token_ids):
        delta.prompt_logprobs.SetInParent()
        delta.prompt_logprobs.entries.extend(
            logprobs_to_proto(entry) for entry in output.prompt_logprobs[1:] if entry is not None
        )
    return delta


@dataclass(frozen=True)
class BlockRun:
    position: int  # of the run's first block in the request's block list
    first_block_id: int  # the receiver's
    length: int


@dataclass(frozen=True)
class BlockLayout:
    """One KV tensor's layout without its block dimension: what a staging copy is made of."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    def allocate(self, num_blocks: int) -> torch.Tensor:
        return torch.empty((*self.shape[:2], num_blocks, *self.shape[2:]), dtype=self.dtype)


def staging_buffers(
    layouts: Sequence[BlockLayout], block_ids: list[int]
) -> tuple[tuple[torch.Tensor, ...], list[torch.Tensor]]:
    """Fresh tensors for a request's blocks and their views matching the sender's
    `source_buffers`, for a receiver whose cache is split over processes."""
    staged = tuple(layout.allocate(len(block_ids)) for layout in layouts)
    return staged, source_buffers(staged, block_ids)


def contiguous_runs(block_ids: list[int]) -> list[BlockRun]:
    runs: list[BlockRun] = []
    for position, block_id in enumerate(block_ids):
        last = runs[-1] if runs else None
        if last is not None and last.first_block_id + last.length == block_id:
            runs[-1] = BlockRun(last.position, last.first_block_id, last.length + 1)
        else:
            runs.append(BlockRun(position, block_id, 1))
    return runs


def source_buffers(
    exported: Sequence[torch.Tensor], destination_block_ids: list[int]
) -> list[torch.Tensor]:
    """Slices of the exported [layers, 2, n, ...] copies, matching `destination_buffers`."""
    for tensor in _tensors(exported):
        if tensor.shape[2] != len(destination_block_ids):
            raise ValueError(
                f"{tensor.shape[2]} exported blocks for {len(destination_block_ids)} destinations"
            )
    runs = contiguous_runs(destination_block_ids)
    spans = [(run.position, run.length) for run in runs]
    return [view for tensor in exported for view in _run_views(tensor, spans)]


def destination_buffers(cache: Sequence[torch.Tensor], block_ids: list[int]) -> list[torch.Tensor]:
    """Views of the receiver's own cache blocks; writing into them fills the cache."""
    cache = _tensors(cache)
    num_blocks = cache[0].shape[2]
    if any(not 0 <= block_id < num_blocks for block_id in block_ids):
        raise ValueError(f"block ids out of range [0, {num_blocks})")
    runs = contiguous_runs(block_ids)
    spans = [(run.first_block_id, run.length) for run in runs]
    return [view for tensor in cache for view in _run_views(tensor, spans)]


def _tensors(tensors: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    # A bare tensor is a sequence too (of its layers): refuse it rather than slice it wrongly.
    if isinstance(tensors, torch.Tensor) or not tensors:
        raise TypeError("expected the KV cache's tensors (KVCache.tensors), not one tensor")
    return tensors


def _run_views(tensor: torch.Tensor, spans: list[tuple[int, int]]) -> list[torch.Tensor]:
    """tensor [layers, 2, blocks, ...]: each span of blocks, layer by layer, K before V."""
    return [
        tensor[layer, half, start : start + length]
        for layer in range(tensor.shape[0])
        for half in range(2)
        for start, length in spans
    ]


class _PromptRequest(Protocol):
    request_id: str
    prompt_token_ids: Iterable[int]
    params: common_pb2.SamplingParams
    priority: int


class OpenedRequest(NamedTuple):
    """A request's checked parameters, prompt, output queue and its metrics record (the caller
    finishes it), once its call is accepted."""

    params: SamplingParams
    prompt: list[int]
    queue: OutputQueue
    record: CallRecord


class EngineServicer:
    def __init__(
        self,
        worker_id: str,
        engine: EngineCore,
        streams: OutputStreams,
        is_draining: Callable[[], bool],
        telemetry: WorkerTelemetry,
        max_open_calls: int,
        max_background_calls: int | None = None,
    ) -> None:
        self._worker_id = worker_id
        self._max_open_calls = max_open_calls
        # Background calls (priority > 0) may hold this many open calls; interactive calls count
        # only against each other, so a batch never turns one away. None: no reserve.
        self._max_background_calls = (
            max_open_calls if max_background_calls is None else max_background_calls
        )
        self._background_request_ids: set[str] = set()
        self._telemetry = telemetry
        self._engine = engine
        self._streams = streams
        self._is_draining = is_draining
        self.num_requests = 0

    @property
    def num_active_requests(self) -> int:
        """Calls still being served (what draining waits for)."""
        return len(self._streams)

    def stats(self, role: str, **transfer_counts: int) -> common_pb2.WorkerStats:
        """This worker's WorkerStats; `transfer_counts`: the role's KV transfer fields."""
        load = self._engine.load
        return common_pb2.WorkerStats(
            worker_id=self._worker_id,
            role=role,
            num_running=load.num_running,
            num_waiting=load.num_waiting,
            num_free_blocks=load.num_free_blocks,
            num_total_blocks=load.num_total_blocks,
            num_requests=self.num_requests,
            draining=bool(self._is_draining()),
            num_requests_holding_blocks=load.num_requests_holding_blocks,
            max_num_seqs=self._engine.facts.config.max_num_seqs,
            max_open_calls=self._max_open_calls,
            num_prompt_tokens_computed=load.num_prompt_tokens_computed,
            spec_decode_num_drafts=load.spec_decode.num_drafts,
            spec_decode_num_draft_tokens=load.spec_decode.num_draft_tokens,
            spec_decode_num_accepted_tokens=load.spec_decode.num_accepted_tokens,
            **transfer_counts,
        )

    async def _open(
        self, request: _PromptRequest, context: grpc.aio.ServicerContext, span_name: str
    ) -> OpenedRequest:
        """Checks the call's parameters and opens its output stream (the caller closes it):
        INVALID_ARGUMENT for bad parameters or a reused id; a full queue: RESOURCE_EXHAUSTED."""
        is_background = request.priority > 0
        num_background = len(self._background_request_ids)
        # An interactive call counts against interactive calls only (the engine runs it first).
        num_counted = len(self._streams) - (0 if is_background else num_background)
        if num_counted >= self._max_open_calls:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self._worker_id} is full: {num_counted} requests running or queued "
                f"(the limit, max-num-seqs + max-queued-requests)",
            )
        if is_background and num_background >= self._max_background_calls:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self._worker_id} is full for background work: "
                f"{len(self._background_request_ids)} background requests running or queued "
                f"(the limit; the rest of its queue is kept for interactive requests)",
            )
        try:
            params = params_from_proto(request.params)
            queue = self._streams.open(request.request_id)
        except ValueError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        if is_background:
            self._background_request_ids.add(request.request_id)
        self.num_requests += 1
        prompt = list(request.prompt_token_ids)
        record = CallRecord(
            self._telemetry,
            span_name,
            request.request_id,
            len(prompt),
            context.invocation_metadata(),
        )
        return OpenedRequest(params, prompt, queue, record)

    def _close(self, request_id: str) -> None:
        """Ends the call's hold on this worker: its output stream and its background slot."""
        self._streams.close(request_id)
        self._background_request_ids.discard(request_id)
