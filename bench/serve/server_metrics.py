"""What the server's own counters say about a run: speculative decoding's acceptance.

The client cannot see drafts, so the figures come from the server's Prometheus text, read
before and after the run (after the warm-ups), as the increase of three cumulative counters
summed over every sample (every worker): verifications (drafts), draft tokens proposed, draft
tokens accepted. Three spellings are read, the first one a text has:

- a Nori gateway's /metrics: `nori_worker_spec_decode_*_total`, one sample per worker;
- a Nori worker's /metrics (`--metrics-port`): `nori_spec_decode_*_total`;
- vLLM's /metrics: `vllm:spec_decode_*_total`, so that A/B runs against vLLM read the same.

No figures (None) when an endpoint cannot be read, has none of the counters, when no draft was
verified during the run (a server without speculation), or when a counter went down (a worker
restarted mid-run: the increase is unknown). The report then simply leaves them out.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger("nori.bench.serve")

SCRAPE_TIMEOUT_S = 10.0
_PREFIXES = ("nori_worker_spec_decode_", "nori_spec_decode_", "vllm:spec_decode_")
_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


@dataclass(frozen=True)
class SpecDecodeTotals:
    """The counters of one scrape (or their increase over a run), summed over the workers."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int

    def minus(self, earlier: SpecDecodeTotals) -> SpecDecodeTotals:
        return SpecDecodeTotals(
            self.num_drafts - earlier.num_drafts,
            self.num_draft_tokens - earlier.num_draft_tokens,
            self.num_accepted_tokens - earlier.num_accepted_tokens,
        )

    def plus(self, other: SpecDecodeTotals) -> SpecDecodeTotals:
        return SpecDecodeTotals(
            self.num_drafts + other.num_drafts,
            self.num_draft_tokens + other.num_draft_tokens,
            self.num_accepted_tokens + other.num_accepted_tokens,
        )


@dataclass(frozen=True)
class SpecDecodeFigures:
    """Speculative decoding over one run (vLLM's definitions, as nori's SpecDecodeCounts)."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verification yields on average: 1 (the bonus token) + accepted drafts."""
        return 1 + self.num_accepted_tokens / self.num_drafts

    def as_dict(self) -> dict[str, object]:
        return {
            "spec_decode_acceptance_rate": self.acceptance_rate,
            "spec_decode_mean_accepted_length": self.mean_accepted_length,
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
        }


def spec_decode_totals(text: str) -> SpecDecodeTotals | None:
    """The counters in one Prometheus text, summed over their samples; None without them."""
    sums: dict[str, dict[str, float]] = {prefix: {} for prefix in _PREFIXES}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            for prefix in _PREFIXES:
                counter = sample.name.removeprefix(prefix).removesuffix("_total")
                if sample.name.startswith(prefix) and counter in _COUNTERS:
                    sums[prefix][counter] = sums[prefix].get(counter, 0.0) + sample.value
    for prefix in _PREFIXES:
        found = sums[prefix]
        if all(counter in found for counter in _COUNTERS):
            return SpecDecodeTotals(*(round(found[counter]) for counter in _COUNTERS))
    return None


def spec_decode_figures(
    before: Sequence[str | None], after: Sequence[str | None]
) -> SpecDecodeFigures | None:
    """The run's figures from the texts of the same endpoints before and after it (an endpoint
    that could not be read is None); None when they cannot be told (see the module's doc)."""
    if len(before) != len(after) or not before:
        return None
    total = SpecDecodeTotals(0, 0, 0)
    for text_before, text_after in zip(before, after, strict=True):
        if text_before is None or text_after is None:
            return None
        start, end = spec_decode_totals(text_before), spec_decode_totals(text_after)
        if start is None or end is None:
            return None
        total = total.plus(end.minus(start))
    if min(total.num_drafts, total.num_draft_tokens, total.num_accepted_tokens) < 0:
        logger.warning("a speculative decoding counter went down during the run (a restart?)")
        return None
    if total.num_drafts == 0:
        return None
    return SpecDecodeFigures(total.num_drafts, total.num_draft_tokens, total.num_accepted_tokens)


async def scrape(client: aiohttp.ClientSession, urls: Sequence[str]) -> list[str | None]:
    """Each endpoint's Prometheus text, None for one that does not answer it."""
    return list(await asyncio.gather(*(_scrape_one(client, url) for url in urls)))


async def _scrape_one(client: aiohttp.ClientSession, url: str) -> str | None:
    try:
        timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)
        async with client.get(url, timeout=timeout) as response:
            if response.status != 200:
                logger.debug("no server metrics at %s: HTTP %d", url, response.status)
                return None
            return await response.text()
    except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError) as error:
        logger.debug("no server metrics at %s: %s", url, error)
        return None
