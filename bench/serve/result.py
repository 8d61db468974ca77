"""The outcome of one run: settings, records and figures, and its JSON form."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from nori.bench.serve.figures import ServeMetrics
from nori.bench.serve.records import RequestRecord
from nori.bench.serve.server_metrics import SpecDecodeFigures
from nori.bench.serve.settings import ServeBenchSettings


@dataclass(frozen=True)
class ServeBenchResult:
    settings: ServeBenchSettings
    # The model the requests named (--model, or the server's first).
    model: str
    metrics: ServeMetrics
    # Every request sent after the warm-ups, in the order they were sent.
    records: tuple[RequestRecord, ...]
    # The mixed dataset's figures per request class ("short", "long"); empty otherwise.
    class_metrics: Mapping[str, ServeMetrics] = field(default_factory=dict)
    # ISO 8601 start of the run (vLLM's result files carry a date too).
    date: str = ""
    # Speculative decoding during the run, from the server's counters; None when the server
    # has none or did not speculate.
    spec_decode: SpecDecodeFigures | None = None

    @property
    def num_sent(self) -> int:
        return len(self.records)

    def to_dict(self, detailed: bool = False) -> dict[str, object]:
        """One flat object in vLLM's result-file style; per-class figures under their class
        name; the `spec_decode_*` figures when the server speculated; with `detailed`, every
        request's record under "requests"."""
        result: dict[str, object] = {
            "date": self.date,
            **self.settings.echo(self.model),
            "num_sent": self.num_sent,
            **self.metrics.as_dict(),
            **(self.spec_decode.as_dict() if self.spec_decode is not None else {}),
        }
        for name, metrics in self.class_metrics.items():
            result[name] = {"num_sent": metrics.completed + metrics.failed, **metrics.as_dict()}
        if detailed:
            result["requests"] = [record.to_dict() for record in self.records]
        return result
