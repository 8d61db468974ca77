"""A hand-made trace of seven requests over a 4 s run, with every figure worked out by hand.

req  send  content chunks            end  tokens  max  finish  prompt  outcome
r0   0.0   0.5 0.75 1.0 1.5          1.5  4       4    length  10      ok (asked 4, got 4)
r1   1.0   1.25 1.5 2.0              2.0  3       3    length  20      ok
r2   1.0   2.0                       2.0  1       8    stop    30      ok (EOS: not truncated)
r3   2.0   2.5 3.0                   3.0  2       10   length  40      truncated (2 < 10)
r4   0.5   -                         0.75 0       5    -       50      HTTP 400
r5   3.0   3.25                      3.5  1       5    -       60      error event mid-stream
r6   3.5   -                         3.75 0       5    -       70      HTTP 400
"""

from __future__ import annotations

from nori.bench.serve.records import RequestRecord

DURATION_S = 4.0
TOO_LONG = "HTTP 400: prompt too long"
STREAM_ERROR = "stream error: worker lost"


def _ok(
    index: int,
    send: float,
    chunks: tuple[float, ...],
    tokens: int,
    max_tokens: int,
    finish: str,
    prompt: int,
) -> RequestRecord:
    return RequestRecord(
        index=index,
        request_class="short" if index % 2 == 0 else "long",
        send_time=send,
        end_time=chunks[-1],
        chunk_times=chunks,
        success=True,
        error=None,
        finish_reason=finish,
        prompt_tokens=prompt,
        output_tokens=tokens,
        max_tokens=max_tokens,
        usage_from_server=True,
    )


def _failed(
    index: int, send: float, end: float, chunks: tuple[float, ...], prompt: int, error: str
) -> RequestRecord:
    return RequestRecord(
        index=index,
        request_class="short" if index % 2 == 0 else "long",
        send_time=send,
        end_time=end,
        chunk_times=chunks,
        success=False,
        error=error,
        finish_reason=None,
        prompt_tokens=prompt,
        output_tokens=len(chunks),
        max_tokens=5,
    )


TRACE = (
    _ok(0, 0.0, (0.5, 0.75, 1.0, 1.5), 4, 4, "length", 10),
    _ok(1, 1.0, (1.25, 1.5, 2.0), 3, 3, "length", 20),
    _ok(2, 1.0, (2.0,), 1, 8, "stop", 30),
    _ok(3, 2.0, (2.5, 3.0), 2, 10, "length", 40),
    _failed(4, 0.5, 0.75, (), 50, TOO_LONG),
    _failed(5, 3.0, 3.5, (3.25,), 60, STREAM_ERROR),
    _failed(6, 3.5, 3.75, (), 70, TOO_LONG),
)
