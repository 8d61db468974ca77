"""What the prefill and decode servicers share: the engine thread, the output streams, draining,
and the figures every worker reports in GetStats."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple, Protocol

import grpc

from nori.rpc.convert import params_from_proto
from nori.sampling.params import SamplingParams
from nori.v1 import common_pb2
from nori.worker.engine_core import EngineCore
from nori.worker.output_streams import OutputQueue, OutputStreams
from nori.worker.request_telemetry import CallRecord, WorkerTelemetry


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
        """Checks the call's parameters and opens its output stream (the caller closes it).
        INVALID_ARGUMENT for bad parameters or a reused id; RESOURCE_EXHAUSTED when the queue
        is full, before any work."""
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
        record = self._telemetry.start(
            span_name, request.request_id, len(prompt), context.invocation_metadata()
        )
        return OpenedRequest(params, prompt, queue, record)

    def _close(self, request_id: str) -> None:
        """Ends the call's hold on this worker: its output stream and its background slot."""
        self._streams.close(request_id)
        self._background_request_ids.discard(request_id)
