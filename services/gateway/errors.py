"""Every error a client can see, and the OpenAI answer each becomes:
`{"error": {"message", "type", "param", "code"}}` with the right status.

Each `BackendError` kind is a direct subclass carrying its own `status_code`, `error_type` and
`retry_after_s` (set: the answer has Retry-After). Every failure reaches the client through
`APIError`; an unexpected exception is logged with its traceback and answered with a generic 500."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from nori.gateway.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger("nori.gateway")

INVALID_REQUEST = "invalid_request_error"


class BackendError(Exception):
    """A request the backend could not serve; `as_api_error` makes it the client's answer."""

    status_code: int = 500
    error_type: str = "internal_error"
    retry_after_s: float | None = None

    def __init__(self, message: str = "", retry_after_s: float | None = None) -> None:
        super().__init__(message)
        if retry_after_s is not None:
            self.retry_after_s = retry_after_s


# ---------------------------------------------------------------------- 400 and 429: the request


class InvalidRequestError(BackendError):
    status_code = 400
    error_type = INVALID_REQUEST


class QueueFullError(BackendError):
    """The gateway's own bound: too many requests or prompt tokens queued (`Ledger.admit`)."""

    status_code = 429
    error_type = "rate_limit_exceeded"
    retry_after_s = 1.0


class ShareRefusedError(BackendError):
    """No slot for the request now: a pool is full, or its owner holds its share."""

    status_code = 429
    error_type = "rate_limit_exceeded"
    retry_after_s = 1.0


class WorkerFullError(BackendError):
    """A worker refused the request before any work (RESOURCE_EXHAUSTED): another may have room."""

    status_code = 429
    error_type = "rate_limit_exceeded"
    retry_after_s = 1.0


class DecodeFullError(BackendError):
    """The decode worker took nothing of the request (full, or the call dropped unserved)."""

    status_code = 429
    error_type = "rate_limit_exceeded"
    retry_after_s = 1.0


# ---------------------------------------------------------------------- 5xx: the workers


class SaturatedError(BackendError):
    """No worker can serve the request now: 503 with Retry-After."""

    status_code = 503
    error_type = "service_unavailable"
    retry_after_s = 1.0


class WorkerUnreachableError(BackendError):
    """A worker did not answer (gone, or its port closed): another one may."""

    status_code = 503
    error_type = "service_unavailable"
    retry_after_s = 1.0


class UpstreamTimeoutError(BackendError):
    status_code = 504
    error_type = "timeout"


class PrefillFailedError(BackendError):
    """A prefill worker failed a prompt; another may compute it (the client has seen nothing)."""

    def __init__(self, message: str, worker_id: str, unreachable: bool = False) -> None:
        super().__init__(message)
        self.worker_id = worker_id
        # The worker itself is gone, not just this prompt.
        self.unreachable = unreachable


class TransferFailedError(BackendError):
    """A decode worker refused or lost a prompt's KV transfer and freed its blocks."""


class WorkerLostError(BackendError):
    """A worker's call broke off mid-way: a request it was decoding may migrate."""

    def __init__(self, message: str, cancelled_by_server: bool = False) -> None:
        super().__init__(message)
        # CANCELLED by the worker's gRPC server (a call dropped from its backlog unserved):
        # before the first message nothing ran there, so the flow retries it elsewhere.
        self.cancelled_by_server = cancelled_by_server


def error_from_rpc(error: grpc.aio.AioRpcError, worker: str) -> BackendError:
    """A worker's failed gRPC call as the error its status means for the request."""
    code, details = error.code(), error.details() or ""
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequestError(details)
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        return WorkerFullError(f"{worker}: {details}", retry_after_s=1.0)
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return UpstreamTimeoutError(f"{worker}: {details}")
    if code is grpc.StatusCode.UNAVAILABLE:
        return WorkerUnreachableError(f"{worker} is unavailable: {details}", retry_after_s=1.0)
    if code is grpc.StatusCode.ABORTED:
        return TransferFailedError(f"{worker}: {details}")
    if code is grpc.StatusCode.CANCELLED:
        return WorkerLostError(
            f"{worker} dropped the call (CANCELLED): {details}", cancelled_by_server=True
        )
    return BackendError(f"{worker} failed ({code.name}): {details}")


# ---------------------------------------------------------------------- the client's answer


class APIError(Exception):
    """An error answered to the client as OpenAI does."""

    def __init__(
        self,
        status_code: int,
        message: str,
        error_type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.error_type = error_type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> ErrorResponse:
        info = ErrorInfo(
            message=self.message, type=self.error_type, param=self.param, code=self.code
        )
        return ErrorResponse(error=info)

    def response(self) -> JSONResponse:
        return JSONResponse(
            self.body().model_dump(), status_code=self.status_code, headers=self.headers
        )


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(HTTPStatus.BAD_REQUEST, message, param=param)


def from_backend_error(error: BackendError) -> APIError:
    headers = {}
    if error.retry_after_s is not None:
        # Whole seconds, never 0 (an immediate retry storm).
        headers["Retry-After"] = str(max(1, math.ceil(error.retry_after_s)))
    message = str(error) or type(error).__name__
    return APIError(error.status_code, message, error.error_type, headers=headers)


def internal_error() -> APIError:
    return APIError(HTTPStatus.INTERNAL_SERVER_ERROR, "internal server error", "internal_error")


def as_api_error(error: BaseException) -> APIError:
    """Any exception raised while serving a request, as what the client should see."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, BackendError):
        if error.status_code == HTTPStatus.INTERNAL_SERVER_ERROR:
            logger.error("backend error: %s", error, exc_info=error)
        elif error.status_code > HTTPStatus.INTERNAL_SERVER_ERROR:
            # Expected under load: one line, no traceback.
            logger.warning("backend error %d: %s", error.status_code, error)
        return from_backend_error(error)
    logger.error("unexpected error while serving a request", exc_info=error)
    return internal_error()


def _location(error: Any) -> list[str]:
    location = [str(item) for item in error.get("loc", ())]
    # FastAPI prefixes body errors with "body"; clients think in field names.
    return location[1:] if location[:1] == ["body"] else location


def _describe_field(field: str, errors: Sequence[Any]) -> str:
    locations = [_location(error) for error in errors]
    if len(errors) == 1:
        return f"{'.'.join(locations[0])}: {errors[0].get('msg', 'invalid value')}"
    # A union: pydantic reports one error per member, tagged with its type. Name the types.
    prefix = locations[0]
    for location in locations[1:]:
        common = 0
        while common < min(len(prefix), len(location)) and prefix[common] == location[common]:
            common += 1
        prefix = prefix[:common]
    tags = list(dict.fromkeys(loc[len(prefix)] for loc in locations if len(loc) > len(prefix)))
    if prefix and tags and not any(tag.isdigit() for tag in tags):
        return f"{'.'.join(prefix)}: expected one of {', '.join(tags)}"
    details = [
        f"{'.'.join(loc)}: {e.get('msg', 'invalid value')}"
        for loc, e in zip(locations, errors, strict=True)
    ]
    return "; ".join(details[:3]) or field


def describe_validation_errors(errors: Sequence[Any]) -> tuple[str, str | None]:
    """pydantic's error list as one readable sentence and the first offending field."""
    for error in errors:
        if error.get("type") == "json_invalid":
            detail = error.get("ctx", {}).get("error", "")
            return f"the request body is not valid JSON ({detail})", None
    by_field: dict[str, list[Any]] = {}
    for error in errors:
        location = _location(error)
        by_field.setdefault(location[0] if location else "", []).append(error)
    parts = []
    for field, field_errors in by_field.items():
        if field:
            parts.append(_describe_field(field, field_errors))
        elif all(e.get("type") == "value_error" for e in field_errors):
            parts.extend(str(e.get("msg", "")).removeprefix("Value error, ") for e in field_errors)
        else:
            parts.append("the request body must be a JSON object")
    params = [field for field in by_field if field]
    return "; ".join(parts) or "invalid request body", params[0] if params else None


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(_: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, APIError)
        return error.response()

    async def on_validation_error(_: Request, error: Exception) -> JSONResponse:
        # FastAPI answers 422; OpenAI (and every client written for it) expects 400.
        assert isinstance(error, RequestValidationError)
        message, param = describe_validation_errors(error.errors())
        return bad_request(message, param).response()

    async def on_http_error(_: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, StarletteHTTPException)
        try:
            phrase = HTTPStatus(error.status_code).phrase
        except ValueError:
            phrase = "error"
        message = error.detail if isinstance(error.detail, str) else phrase
        error_type = INVALID_REQUEST if error.status_code < 500 else "internal_error"
        api_error = APIError(error.status_code, message, error_type, headers=error.headers)
        return api_error.response()

    async def on_unexpected(_: Request, error: Exception) -> JSONResponse:
        return as_api_error(error).response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)
