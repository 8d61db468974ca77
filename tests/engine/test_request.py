"""Request counters, and the left padding of the static-batching baseline."""

from __future__ import annotations

import pytest

from tests.engine.helpers import make_request


def test_left_padding_counts_as_prompt_but_not_against_the_model_length() -> None:
    request = make_request("a", [7, 8, 9])
    request.left_pad(2, 0)
    assert request.token_ids == [0, 0, 7, 8, 9]
    assert request.num_prompt_tokens == 5 and request.num_unpadded_tokens == 3
    request.append_token(4)
    assert request.output_token_ids == [4] and request.num_output_tokens == 1
    assert request.prompt_token_ids == [7, 8, 9]


def test_padding_again_replaces_the_earlier_padding() -> None:
    """A preempted member of a static batch may join a batch with a different longest prompt."""
    request = make_request("a", [7, 8, 9])
    request.left_pad(4, 0)
    request.append_token(5)
    request.left_pad(1, 3)
    assert request.token_ids == [3, 7, 8, 9, 5]
    assert request.num_padding_tokens == 1 and request.output_token_ids == [5]
    request.left_pad(0, 0)
    assert request.token_ids == [7, 8, 9, 5]


def test_padding_is_refused_once_tokens_are_computed() -> None:
    request = make_request("a", [7, 8, 9])
    request.num_computed_tokens = 2
    with pytest.raises(ValueError, match="cannot pad after computing"):
        request.left_pad(1, 0)
    with pytest.raises(ValueError, match=">= 0"):
        make_request("b", [1]).left_pad(-1, 0)
