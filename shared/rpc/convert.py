"""Engine types to nori.v1 messages and back. Every field crosses the wire exactly."""

from __future__ import annotations

from nori.engine.outputs import RequestOutput
from nori.sampling.logprobs import TokenLogprobs
from nori.sampling.params import SamplingParams
from nori.v1 import common_pb2


def params_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    message = common_pb2.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        include_stop_str_in_output=params.include_stop_str_in_output,
        ignore_eos=params.ignore_eos,
        min_tokens=params.min_tokens,
        skip_special_tokens=params.skip_special_tokens,
    )
    if params.seed is not None:
        message.seed = params.seed
    if params.logprobs is not None:
        message.logprobs = params.logprobs
    return message


def params_from_proto(message: common_pb2.SamplingParams) -> SamplingParams:
    """Raises ValueError (from SamplingParams) for values no engine accepts."""
    return SamplingParams(
        max_tokens=message.max_tokens,
        temperature=message.temperature,
        top_p=message.top_p,
        top_k=message.top_k,
        min_p=message.min_p,
        seed=message.seed if message.HasField("seed") else None,
        repetition_penalty=message.repetition_penalty,
        presence_penalty=message.presence_penalty,
        frequency_penalty=message.frequency_penalty,
        stop=tuple(message.stop),
        stop_token_ids=tuple(message.stop_token_ids),
        include_stop_str_in_output=message.include_stop_str_in_output,
        ignore_eos=message.ignore_eos,
        min_tokens=message.min_tokens,
        logprobs=message.logprobs if message.HasField("logprobs") else None,
        skip_special_tokens=message.skip_special_tokens,
    )


def logprobs_to_proto(entry: TokenLogprobs) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=entry.token_id,
        logprob=entry.logprob,
        rank=entry.rank,
        top_token_ids=[token for token, _ in entry.top],
        top_logprobs=[value for _, value in entry.top],
    )


def logprobs_from_proto(message: common_pb2.TokenLogprob) -> TokenLogprobs:
    return TokenLogprobs(
        token_id=message.token_id,
        logprob=message.logprob,
        rank=message.rank,
        top=tuple(zip(message.top_token_ids, message.top_logprobs, strict=True)),
    )


def delta_from_output(output: RequestOutput) -> common_pb2.TokenDelta:
    """What one engine step added to a request, as a wire delta."""
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
    return delta


def stop_reason_from_proto(delta: common_pb2.TokenDelta) -> str | int | None:
    kind = delta.WhichOneof("stop_reason")
    if kind == "stop_string":
        return delta.stop_string
    if kind == "stop_token_id":
        return delta.stop_token_id
    return None
