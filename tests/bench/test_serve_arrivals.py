"""Send times of `nori bench serve`: seeded, Poisson by default, gamma with burstiness."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import numpy as np
import pytest

from nori.bench.serve.arrivals import arrival_gaps, arrival_times


def take(iterator: Iterator[float], count: int) -> list[float]:
    return list(itertools.islice(iterator, count))


def gaps(rate: float, burstiness: float, count: int, seed: int = 0) -> np.ndarray:
    return np.array(take(arrival_gaps(rate, burstiness, np.random.default_rng(seed)), count))


def test_seed_reproduces_the_send_times() -> None:
    first = take(arrival_times(3.0, 1.0, seed=7), 2000)  # crosses a block of drawn gaps
    assert first == take(arrival_times(3.0, 1.0, seed=7), 2000)
    assert first != take(arrival_times(3.0, 1.0, seed=8), 2000)
    assert first[0] == 0.0
    assert all(later > earlier for earlier, later in itertools.pairwise(first))


def test_poisson_gaps_have_mean_one_over_rate() -> None:
    drawn = gaps(4.0, 1.0, 40_000)
    assert drawn.mean() == pytest.approx(0.25, rel=0.02)
    # Exponential: the standard deviation equals the mean.
    assert drawn.std() == pytest.approx(0.25, rel=0.03)


def test_burstiness_changes_the_variance_not_the_mean() -> None:
    bursty, regular = gaps(2.0, 0.25, 40_000), gaps(2.0, 4.0, 40_000)
    assert bursty.mean() == pytest.approx(0.5, rel=0.03)
    assert regular.mean() == pytest.approx(0.5, rel=0.03)
    # Gamma(shape b, mean 1/R): variance 1 / (b R^2).
    assert bursty.var() == pytest.approx(1 / (0.25 * 4), rel=0.08)
    assert regular.var() == pytest.approx(1 / (4.0 * 4), rel=0.08)
    assert bursty.var() > 10 * regular.var()


def test_infinite_rate_sends_everything_at_once() -> None:
    assert take(arrival_times(math.inf), 100) == [0.0] * 100
    assert set(gaps(math.inf, 0.5, 50)) == {0.0}


def test_infinite_burstiness_is_a_fixed_gap() -> None:
    assert take(arrival_times(4.0, math.inf), 4) == [0.0, 0.25, 0.5, 0.75]


def test_rate_and_burstiness_must_be_positive() -> None:
    with pytest.raises(ValueError):
        take(arrival_gaps(0.0, 1.0, np.random.default_rng(0)), 1)
    with pytest.raises(ValueError):
        take(arrival_gaps(1.0, -1.0, np.random.default_rng(0)), 1)
