"""Sampling types to nori.v1 messages and back (the worker turns its engine's outputs into
deltas, `nori.worker.servicer_base.delta_from_output`). Every field crosses the wire exactly."""

from __future__ import annotations

from nori.sampling.logprobs import TokenLogprobs
from nori.sampling.params import SamplingParams
from nori.v1 import common_pb2

# The wire message mirrors SamplingParams field for field (a test holds them equal), so both
# directions walk the message's fields: a new parameter needs no code here.
_SAMPLING_FIELDS = common_pb2.SamplingParams.DESCRIPTOR.fields


def params_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    message = common_pb2.SamplingParams()
    for field in _SAMPLING_FIELDS:
        value = getattr(params, field.name)
        if field.is_repeated:
            getattr(message, field.name).extend(value)
        elif value is not None:  # an unset optional (seed, logprobs) stays unset
            setattr(message, field.name, value)
    return message


def params_from_proto(message: common_pb2.SamplingParams) -> SamplingParams:
    """Raises ValueError (from SamplingParams) for values no engine accepts."""
    values: dict[str, object] = {}
    for field in _SAMPLING_FIELDS:
        value = getattr(message, field.name)
        if field.is_repeated:
            value = tuple(value)
        elif field.has_presence and not message.HasField(field.name):
            value = None
        values[field.name] = value
    return SamplingParams(**values)  # type: ignore[arg-type]


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


def prompt_logprobs_from_delta(delta: common_pb2.TokenDelta) -> list[TokenLogprobs | None] | None:
    """The prompt logprobs a delta carries (the first token's None in front), else None."""
    if not delta.HasField("prompt_logprobs"):
        return None
    entries = [logprobs_from_proto(entry) for entry in delta.prompt_logprobs.entries]
    return [None, *entries]


def stop_reason_from_proto(delta: common_pb2.TokenDelta) -> str | int | None:
    kind = delta.WhichOneof("stop_reason")
    if kind == "stop_string":
        return delta.stop_string
    if kind == "stop_token_id":
        return delta.stop_token_id
    return None
