"""Builders shared by the pure scheduler and block-manager tests."""

from __future__ import annotations

from nori.engine.request import Request


def make_request(request_id: str, token_ids: list[int], arrival_index: int = 0) -> Request:
    # The scheduler and block manager never read sampling parameters.
    return Request(request_id, list(token_ids), sampling_params=None, arrival_index=arrival_index)  # type: ignore[arg-type]
