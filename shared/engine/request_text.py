"""The engine's text side of a request: the sampled token through the incremental detokenizer,
the stop checks, and the output that reports what is new. Works on the request's own fields
(`Request.detokenizer`, `text`, `num_emitted_*`, ...), so a request is one record."""

from __future__ import annotations

from nori.engine.outputs import StepOutput
from nori.engine.request import Request, RequestStatus


def check_stop(
    request: Request, token_id: int, eos_token_ids: frozenset[int], max_model_len: int
) -> RequestStatus | None:
    """Feeds the sampled token (already appended to the request) to the detokenizer; the finish
    status when it ends the request, else None."""
    assert request.detokenizer is not None
    params = request.sampling_params
    result = request.detokenizer.add_token(token_id)
    request.text += result.new_text
    num_output = request.num_output_tokens
    if num_output >= params.min_tokens:
        if token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return _flush(request, RequestStatus.FINISHED_STOPPED)
        if not params.ignore_eos and token_id in eos_token_ids:
            return _flush(request, RequestStatus.FINISHED_STOPPED)
        if result.stop_string is not None:
            request.stop_reason = result.stop_string
            return RequestStatus.FINISHED_STOPPED
    if num_output >= params.max_tokens or request.num_tokens >= max_model_len:
        return _flush(request, RequestStatus.FINISHED_LENGTH)
    return None


def add_known_tokens(request: Request, token_ids: list[int]) -> None:
    """Tokens sampled elsewhere (the prefill side of a hand-off): into the text, no stop checks."""
    assert request.detokenizer is not None
    for token_id in token_ids:
        request.text += request.detokenizer.add_token(token_id).new_text


def resume_text(request: Request, token_ids: list[int], num_emitted_chars: int) -> None:
    """A resumed request's known output (migration): through the detokenizer, so later text
    continues it; the tokens and `num_emitted_chars` of their text count as already streamed
    (text held back there, a possible stop string, is still to come)."""
    add_known_tokens(request, token_ids)
    request.num_emitted_tokens = len(request.output_token_ids)
    request.num_emitted_chars = min(num_emitted_chars, len(request.text))


def _flush(request: Request, status: RequestStatus) -> RequestStatus:
    assert request.detokenizer is not None
    request.text += request.detokenizer.flush().new_text
    return status


def make_output(request: Request) -> StepOutput:
    """What is new since the last output (the whole text so far, too); marks it reported."""
    status = request.status
    output_ids = request.output_token_ids
    finished = status.is_finished
    result = StepOutput(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        token_ids=output_ids,
        text=request.text,
        new_token_ids=output_ids[request.num_emitted_tokens :],
        new_text=request.text[request.num_emitted_chars :],
        finished=finished,
        finish_reason=status.value if finished else None,
        stop_reason=request.stop_reason,
        logprobs=list(request.logprobs) if request.logprobs is not None else None,
        # Complete once a token is sampled, and never changed after: shared, not copied.
        prompt_logprobs=request.prompt_logprobs,
        num_cached_tokens=request.num_cached_tokens,
        prefilled=status is RequestStatus.PREFILLED,
        scheduled_at=request.first_scheduled_at,
    )
    request.num_emitted_tokens = len(output_ids)
    request.num_emitted_chars = len(request.text)
    return result


def aborted_output(request: Request) -> StepOutput:
    """The last output of a request ended by `abort_all`: its tokens, no text."""
    return StepOutput(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        token_ids=request.output_token_ids,
        text="",
        new_token_ids=[],
        new_text="",
        finished=True,
        finish_reason=RequestStatus.FINISHED_ABORTED.value,
    )
