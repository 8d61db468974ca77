"""Builders shared by the pure scheduler and block-manager tests."""

from __future__ import annotations

from nori.engine.request import Request


def make_request(
    request_id: str,
    token_ids: list[int],
    arrival_index: int = 0,
    max_new_tokens: int = 0,
    priority: int = 0,
) -> Request:
    # The scheduler and block manager never read sampling parameters.
    return Request(
        request_id,
        list(token_ids),
        sampling_params=None,  # type: ignore[arg-type]
        arrival_index=arrival_index,
        max_new_tokens=max_new_tokens,
        priority=priority,
    )
