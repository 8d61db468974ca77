"""What the client saw of one request: the raw facts every metric is computed from.

Times are seconds since the start of the run (warm-ups excluded), read from one monotonic clock.
A "content chunk" is a streamed event that carried text; the server may send several tokens in
one chunk, or none in a chunk that only closes the stream, so chunks are not tokens: token
counts come from the server's usage report when it sends one.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class RequestRecord:
    index: int
    # "short" / "long" in the mixed dataset; the dataset's name otherwise.
    request_class: str
    send_time: float
    # When the stream ended ([DONE]), or when the request failed.
    end_time: float
    chunk_times: tuple[float, ...]
    success: bool
    error: str | None
    finish_reason: str | None
    prompt_tokens: int
    output_tokens: int
    max_tokens: int
    # Whether the token counts are the server's usage report (else counted by the client).
    usage_from_server: bool = False

    @property
    def ttft(self) -> float | None:
        """Time to the first content chunk; None for a failed request or one with no text."""
        if not self.success or not self.chunk_times:
            return None
        return self.chunk_times[0] - self.send_time

    @property
    def e2el(self) -> float | None:
        return self.end_time - self.send_time if self.success else None

    @property
    def decode_time(self) -> float | None:
        """From the first content chunk to the end: the time spent on tokens 2..n."""
        ttft, e2el = self.ttft, self.e2el
        if ttft is None or e2el is None or self.output_tokens < 2:
            return None
        return e2el - ttft

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (vLLM's TPOT)."""
        decode = self.decode_time
        return None if decode is None else decode / (self.output_tokens - 1)

    @property
    def decode_tok_s(self) -> float | None:
        """This request's own decode speed, tokens 2..n per second."""
        decode = self.decode_time
        if decode is None or decode <= 0:
            return None
        return (self.output_tokens - 1) / decode

    @property
    def itls(self) -> tuple[float, ...]:
        """Gaps between consecutive content chunks."""
        if not self.success:
            return ()
        return tuple(later - earlier for earlier, later in itertools.pairwise(self.chunk_times))

    @property
    def truncated(self) -> bool:
        """Stopped for length before the max_tokens it asked for: the server cut it short,
        e.g. at its context length, so it did not do the work the benchmark meant it to."""
        return (
            self.success and self.finish_reason == "length" and self.output_tokens < self.max_tokens
        )

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["chunk_times"] = list(self.chunk_times)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestRecord:
        return cls(**{**data, "chunk_times": tuple(data["chunk_times"])})
