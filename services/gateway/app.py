"""The gateway's FastAPI app over any `Backend`: the OpenAI routes, /tokenize and /detokenize,
health and metrics. The app owns the backend and closes it at shutdown (unless told not to)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from functools import lru_cache
from http import HTTPStatus

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from nori.gateway.backend import Backend
from nori.gateway.endpoints import create_chat_completion, create_completion, off_loop_if_large
from nori.gateway.errors import APIError, as_api_error, bad_request, install_error_handlers
from nori.gateway.middleware import (
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    Drain,
    DrainMiddleware,
    EchoRequestIdMiddleware,
    ExtraMetrics,
    GatewayMetrics,
    RequestMetricsMiddleware,
    prompt_body_limit,
)
from nori.gateway.prompts import (
    ServingContext,
    chat_prompt,
    check_model,
    check_token_ids,
    refuse_hopeless_text,
)
from nori.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from nori.sampling.chat_template import TemplateLimits
from nori.sampling.tokenizer import Tokenizer

logger = logging.getLogger("nori.gateway")
# What the app's shutdown waits for its request tasks' cancellation, then for the backend's close.
SHUTDOWN_WAIT_S = 5.0


async def _shutdown(tasks: set[asyncio.Task[None]], backend: Backend | None) -> None:
    """Cancels the request tasks and closes the backend, each within SHUTDOWN_WAIT_S: a stop
    never hangs; what did not end is logged with where it waits."""
    for task in list(tasks):
        task.cancel()
    if tasks:
        _, pending = await asyncio.wait(list(tasks), timeout=SHUTDOWN_WAIT_S)
        if pending:
            where = sorted({_waits_at(task) for task in pending})
            logger.warning("shutdown: %d request task(s) still running: %s", len(pending), where)
    if backend is not None:
        try:
            await asyncio.wait_for(backend.close(), SHUTDOWN_WAIT_S)
        except TimeoutError:
            logger.warning("shutdown: the backend did not close within %.0f s", SHUTDOWN_WAIT_S)


def _waits_at(task: asyncio.Task[None]) -> str:
    frames = task.get_stack()
    return f"{frames[-1].f_code.co_filename}:{frames[-1].f_lineno}" if frames else "?"


COMPLETIONS_PATH = "/v1/completions"
CHAT_COMPLETIONS_PATH = "/v1/chat/completions"
MODELS_PATH = "/v1/models"
TOKENIZE_PATH = "/tokenize"
DETOKENIZE_PATH = "/detokenize"
HEALTH_PATH = "/health"
METRICS_PATH = "/metrics"

# Token id -> text, for every logprob: bounded by the vocabulary in practice.
_TOKEN_TEXT_CACHE_SIZE = 1 << 18
# Template steps per token of context (a conversation that fits takes far fewer), with a floor.
_TEMPLATE_STEPS_PER_TOKEN = 8
_MIN_TEMPLATE_STEPS = TemplateLimits.max_steps


def create_app(
    backend: Backend,
    tokenizer: Tokenizer,
    served_model_name: str,
    max_model_len: int,
    *,
    vocab_size: int | None = None,
    extra_metrics: ExtraMetrics | None = None,
    close_backend_on_shutdown: bool = True,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    api_keys: Sequence[str] = (),
    routers: Sequence[APIRouter] = (),
    path_body_limits: Mapping[str, int] | None = None,
    stream_interval: int = 1,
    drain: Drain | None = None,
) -> FastAPI:
    """The OpenAI-compatible app for one served model.

    `max_model_len`: the longest prompt + output accepted (longer: a 400). `vocab_size`: prompt
    token ids must be below it (default: the tokenizer's). `extra_metrics`: Prometheus text for
    GET /metrics. `routers`: more routes (the Batch API) behind the same middleware, with
    `path_body_limits`. `stream_interval`: tokens per event. `drain`: 503 while it drains."""
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
    if stream_interval < 1:
        raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
    max_token_bytes = max(
        (
            len(tokenizer.decode([i], skip_special_tokens=False).encode())
            for i in range(tokenizer.vocab_size)
        ),
        default=1,
    )
    metrics = GatewayMetrics(
        frozenset((COMPLETIONS_PATH, CHAT_COMPLETIONS_PATH, MODELS_PATH, HEALTH_PATH, METRICS_PATH))
    )
    tasks: set[asyncio.Task[None]] = set()

    @lru_cache(maxsize=_TOKEN_TEXT_CACHE_SIZE)
    def token_text(token_id: int) -> str:
        # Decoded alone, as vLLM reports logprob tokens: " the" rather than "Ġthe".
        return tokenizer.decode([token_id], skip_special_tokens=False)

    ctx = ServingContext(
        backend=backend,
        tokenizer=tokenizer,
        model_name=served_model_name,
        max_model_len=max_model_len,
        vocab_size=vocab_size if vocab_size is not None else tokenizer.vocab_size,
        metrics=metrics,
        tasks=tasks,
        token_text=token_text,
        max_token_bytes=max_token_bytes,
        stream_interval=stream_interval,
        # Longer rendered text cannot fit the context (prompts.refuse_hopeless_text).
        template_limits=TemplateLimits(
            max_steps=max(_MIN_TEMPLATE_STEPS, _TEMPLATE_STEPS_PER_TOKEN * max_model_len),
            max_output_chars=max(1 << 20, 4 * max_token_bytes * max_model_len),
        ),
    )
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await _shutdown(tasks, backend if close_backend_on_shutdown else None)

    app = FastAPI(title="Nori gateway", lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics)
    app.add_middleware(EchoRequestIdMiddleware)
    # Added last = outermost: the key is checked first, then the body's size.
    prompt_limit = prompt_body_limit(max_model_len, max_request_body_bytes)
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=max_request_body_bytes,
        path_limits={
            path: prompt_limit
            for path in (COMPLETIONS_PATH, CHAT_COMPLETIONS_PATH, TOKENIZE_PATH, DETOKENIZE_PATH)
        }
        | dict(path_body_limits or {}),
    )
    if api_keys:
        app.add_middleware(ApiKeyMiddleware, keys=api_keys, open_paths=(HEALTH_PATH, METRICS_PATH))
    if drain is not None:
        app.add_middleware(
            DrainMiddleware,
            drain=drain,
            open_paths=(HEALTH_PATH, METRICS_PATH),
            health_path=HEALTH_PATH,
        )

    @app.post(COMPLETIONS_PATH, response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _answer(create_completion(ctx, body, request))

    @app.post(CHAT_COMPLETIONS_PATH, response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _answer(create_chat_completion(ctx, body, request))

    def model_card() -> ModelCard:
        return ModelCard(
            id=served_model_name,
            created=created,
            root=served_model_name,
            max_model_len=max_model_len,
        )

    @app.post(TOKENIZE_PATH)
    async def tokenize_prompt(body: TokenizeRequest, request: Request) -> JSONResponse:
        if body.messages is not None:  # a template renders: never on the event loop
            answer = await asyncio.to_thread(tokenize, ctx, body)
        else:
            answer = await off_loop_if_large(request, tokenize, ctx, body)
        return JSONResponse(answer.model_dump())

    @app.post(DETOKENIZE_PATH)
    async def detokenize_tokens(body: DetokenizeRequest, request: Request) -> JSONResponse:
        answer = await off_loop_if_large(request, detokenize, ctx, body)
        return JSONResponse(answer.model_dump())

    @app.get(MODELS_PATH)
    async def list_models() -> JSONResponse:
        return JSONResponse(ModelList(data=[model_card()]).model_dump())

    @app.get(MODELS_PATH + "/{model_id:path}")
    async def retrieve_model(model_id: str) -> JSONResponse:
        if model_id != served_model_name:
            raise APIError(
                HTTPStatus.NOT_FOUND,
                f"The model `{model_id}` does not exist.",
                param="model",
                code="model_not_found",
            )
        return JSONResponse(model_card().model_dump())

    @app.get(HEALTH_PATH)
    async def health() -> JSONResponse:
        try:
            state = await backend.health()
        except Exception as error:
            logger.warning("backend health check failed: %s", error)
            body = {"status": "unhealthy", "workers": {}, "detail": f"health check failed: {error}"}
            return JSONResponse(body, status_code=HTTPStatus.SERVICE_UNAVAILABLE)
        body = {
            "status": "ok" if state.healthy else "unhealthy",
            "workers": dict(state.workers),
            "detail": state.detail,
        }
        status = HTTPStatus.OK if state.healthy else HTTPStatus.SERVICE_UNAVAILABLE
        return JSONResponse(body, status_code=status)

    @app.get(METRICS_PATH)
    async def metrics_text() -> PlainTextResponse:
        text = await metrics.render(extra_metrics)
        return PlainTextResponse(text, media_type=CONTENT_TYPE_LATEST)

    for router in routers:
        app.include_router(router)

    return app


async def _answer(response: Awaitable[Response]) -> Response:
    try:
        return await response
    except Exception as error:
        # Not by an exception handler: Starlette re-raises (and logs) what reaches its catch-all.
        return as_api_error(error).response()


# /tokenize and /detokenize, as vLLM serves them; nothing reaches a worker.


def tokenize(ctx: ServingContext, body: TokenizeRequest) -> TokenizeResponse:
    check_model(ctx, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give either `prompt` or `messages`", "prompt")
    if body.messages is not None:
        tokens = chat_prompt(ctx, body)
    else:
        assert body.prompt is not None
        refuse_hopeless_text(ctx, body.prompt, "prompt")
        tokens = ctx.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    token_strs = None
    if body.return_token_strs:
        token_strs = [ctx.tokenizer.id_to_token(token) or "" for token in tokens]
    return TokenizeResponse(
        count=len(tokens), max_model_len=ctx.max_model_len, tokens=tokens, token_strs=token_strs
    )


def detokenize(ctx: ServingContext, body: DetokenizeRequest) -> DetokenizeResponse:
    check_model(ctx, body.model)
    tokens = check_token_ids(ctx, body.tokens, "tokens") if body.tokens else []
    # Special tokens stay, as in vLLM.
    return DetokenizeResponse(prompt=ctx.tokenizer.decode(tokens, skip_special_tokens=False))
