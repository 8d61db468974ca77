"""Finding stop strings in a growing output text without rescanning all of it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StopMatch:
    index: int  # where the stop string starts in the text
    stop: str


def find_stop(
    text: str, new_char_count: int, stops: Sequence[str], floor: int = 0
) -> StopMatch | None:
    """Earliest stop string that overlaps the last `new_char_count` characters of `text` (ties:
    first in `stops`). Earlier text was searched on an earlier call, so each stop string is only
    looked for from `len(text) - new_char_count - len(stop) + 1` on. `floor` excludes text that
    must never stop the request (produced before `min_tokens`)."""
    if new_char_count <= 0:
        return None
    best: StopMatch | None = None
    for stop in stops:
        start = max(floor, len(text) - new_char_count - len(stop) + 1, 0)
        index = text.find(stop, start)
        if index >= 0 and (best is None or index < best.index):
            best = StopMatch(index, stop)
    return best
