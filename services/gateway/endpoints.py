"""`/v1/completions` and `/v1/chat/completions`: a body becomes prompts, sampling parameters and
the backend's requests (one per choice), named after the client's `x-request-id` and described on
the request's span; `responder.respond` serves them in the API's format (`formats.py`)."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response
from opentelemetry import trace
from starlette.types import Scope

from nori.gateway.backend import GenerationRequest
from nori.gateway.formats import ChatFormat, CompletionFormat, EchoedPrompt
from nori.gateway.middleware import client_request_id, response_id, worker_request_id_base
from nori.gateway.prompts import (
    ServingContext,
    chat_max_tokens_field,
    chat_prompt,
    chat_sampling_params,
    check_chat,
    check_completion,
    check_model,
    check_stop_token_ids,
    completion_max_tokens,
    completion_prompts,
    completion_sampling_params,
    echoed_prompts,
    resolve_max_tokens,
    sample_params,
)
from nori.gateway.protocol import ChatCompletionRequest, CompletionRequest
from nori.gateway.responder import respond
from nori.sampling.params import SamplingParams

# Bodies above this many bytes are tokenized on a worker thread: a 10 MB prompt takes the
# tokenizer seconds, which on the event loop would stall every stream and /health.
LARGE_BODY_BYTES = 64 * 1024
# A non-streamed request's outputs come from the decode worker at most this often after its
# first token: per-token messages would cost the worker and the gateway for nobody.
COALESCE_MS = 1000
# gen_ai.provider.name: this server (the conventions' list names the hosted APIs).
PROVIDER_NAME = "nori"
_Result = TypeVar("_Result")


async def off_loop_if_large(request: Request, work: Callable[..., _Result], *args: Any) -> _Result:
    """`work(*args)`, on a thread when the request body is large or of unstated size (small
    ones stay inline: a thread hop costs more than tokenizing a short prompt)."""
    size = request.headers.get("content-length", "")
    if size.isdigit() and int(size) <= LARGE_BODY_BYTES:
        return work(*args)
    return await asyncio.to_thread(work, *args)


async def create_completion(
    ctx: ServingContext, body: CompletionRequest, request: Request
) -> Response:
    check_model(ctx, body.model)
    check_completion(body)
    check_stop_token_ids(body, ctx.vocab_size)
    distinct = await off_loop_if_large(request, completion_prompts, ctx, body.prompt)
    n = body.n
    # Choice k is sample k % n of prompt k // n: OpenAI's order of a batch's choices.
    prompts = [prompt for prompt in distinct for _ in range(n)]
    params = [
        sample
        for p in distinct
        for sample in sample_params(
            completion_sampling_params(
                body, completion_max_tokens(body, len(p), ctx.max_model_len)
            ),
            n,
        )
    ]
    echo = []
    if body.echo:
        texts = echoed_prompts(ctx, body.prompt)
        echo = [EchoedPrompt(t, p) for t, p in zip(texts, distinct, strict=True) for _ in range(n)]
    client_id = client_request_id(request.scope)
    completion_id = response_id("cmpl", client_id)
    base = worker_request_id_base(completion_id, client_id)
    request_ids = [f"{base}-{index}" for index in range(len(prompts))]
    span = describe_request("text_completion", ctx.model_name, params[0], completion_id)
    requests = generation_requests(
        ctx, request, request_ids, prompts, params, n, body.priority, bool(body.stream)
    )
    form = CompletionFormat(ctx.model_name, ctx.token_text, body, completion_id, echo)
    return await respond(ctx, requests, form, request, bool(body.stream), n, span)


async def create_chat_completion(
    ctx: ServingContext, body: ChatCompletionRequest, request: Request
) -> Response:
    check_model(ctx, body.model)
    check_chat(body)
    check_stop_token_ids(body, ctx.vocab_size)
    # Always on a thread: the template (perhaps the request's own) runs up to its time limit.
    prompt = await asyncio.to_thread(chat_prompt, ctx, body)
    requested, param = chat_max_tokens_field(body)
    max_tokens = resolve_max_tokens(requested, param, len(prompt), ctx.max_model_len)
    client_id = client_request_id(request.scope)
    completion_id = response_id("chatcmpl", client_id)
    base = worker_request_id_base(completion_id, client_id)
    request_ids = [base] if body.n == 1 else [f"{base}-{index}" for index in range(body.n)]
    params = sample_params(chat_sampling_params(body, max_tokens), body.n)
    span = describe_request("chat", ctx.model_name, params[0], completion_id)
    requests = generation_requests(
        ctx,
        request,
        request_ids,
        [prompt] * body.n,
        params,
        body.n,
        body.priority,
        bool(body.stream),
    )
    form = ChatFormat(ctx.model_name, ctx.token_text, body, completion_id)
    return await respond(ctx, requests, form, request, bool(body.stream), body.n, span)


def generation_requests(
    ctx: ServingContext,
    http_request: Request,
    request_ids: Sequence[str],
    prompts: Sequence[list[int]],
    params: Sequence[SamplingParams],
    samples_per_prompt: int,
    priority: int,
    streamed: bool,
) -> list[GenerationRequest]:
    """One backend request per choice: `prompts[i]` is choice i's prompt; with n > 1 each prompt
    stands n times in a row (`samples_per_prompt`). The choices of one HTTP request are one
    admission group; their owner for the decode pool's shares is `client_identity`; `priority`
    is the body's (vLLM's; lower first). Not `streamed`: the answer is one body at the end, so
    the workers send their outputs merged (`COALESCE_MS`)."""
    group = request_ids[0] if len(prompts) > 1 else None
    client = client_identity(http_request.scope)
    return [
        GenerationRequest(
            request_id,
            prompt,
            p,
            admission_group=group,
            client=client,
            group_size=len(prompts),
            num_choices=samples_per_prompt,
            priority=priority,
            coalesce_ms=0 if streamed else COALESCE_MS,
            stream_interval=ctx.stream_interval if streamed else 1,
        )
        for request_id, prompt, p in zip(request_ids, prompts, params, strict=True)
    ]


def client_identity(scope: Scope) -> str:
    """Who sent a request, for fair shares: its API key (a digest: the key itself is never
    kept), else its address. Behind a proxy every keyless client is one address, and clients
    sharing one key are one owner; the request's own share bounds them still."""
    header = dict(scope.get("headers", [])).get(b"authorization", b"")
    scheme, _, token = header.partition(b" ")
    if scheme.lower() == b"bearer" and token.strip():
        return "key:" + hashlib.sha256(token.strip()).hexdigest()[:16]
    client = scope.get("client")
    return f"addr:{client[0]}" if client else "addr:unknown"


def describe_request(
    operation: str, model: str, params: SamplingParams, response_id: str
) -> trace.Span:
    """Sets the OpenTelemetry GenAI request attributes on the current (server) span and
    returns it."""
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attributes(
            {
                "gen_ai.operation.name": operation,
                "gen_ai.provider.name": PROVIDER_NAME,
                "gen_ai.request.model": model,
                "gen_ai.request.max_tokens": params.max_tokens,
                "gen_ai.request.temperature": params.temperature,
                "gen_ai.request.top_p": params.top_p,
                "gen_ai.response.id": response_id,
            }
        )
    return span
