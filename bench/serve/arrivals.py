"""When requests are sent: an infinite, seeded sequence of send times.

As in vLLM, gaps are gamma-distributed with shape `burstiness` and mean 1/rate: burstiness 1 is
a Poisson process (exponential gaps), below 1 burstier, above 1 more regular, infinite a fixed
gap. An infinite rate sends everything at once. Unlike vLLM, the first request goes at time
zero rather than after a first random gap (which only delays the whole run), and the gaps are
not rescaled to make N requests last exactly N/rate seconds: a --duration run has no N, and
the rescaling would make the gaps depend on it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

# Gaps are drawn this many at a time: one numpy call per block, not per request.
_BLOCK = 1024


def arrival_gaps(rate: float, burstiness: float, rng: np.random.Generator) -> Iterator[float]:
    """Gaps between consecutive requests, in seconds."""
    if not rate > 0 or not burstiness > 0:
        raise ValueError(f"rate and burstiness must be > 0, got {rate} and {burstiness}")
    if math.isinf(rate):
        while True:
            yield 0.0
    if math.isinf(burstiness):
        while True:
            yield 1.0 / rate
    scale = 1.0 / (rate * burstiness)
    while True:
        yield from (float(gap) for gap in rng.gamma(burstiness, scale, size=_BLOCK))


def arrival_times(
    rate: float, burstiness: float = 1.0, seed: int | tuple[int, ...] = 0
) -> Iterator[float]:
    """Send times from the start of the run: 0, then the running sum of the gaps."""
    now = 0.0
    gaps = arrival_gaps(rate, burstiness, np.random.default_rng(seed))
    while True:
        yield now
        now += next(gaps)
