from __future__ import annotations

import pytest

from nori.sampling.params import SamplingParams


def test_defaults_match_vllm() -> None:
    params = SamplingParams()
    assert params.max_tokens == 16
    assert params.temperature == 1.0
    assert not params.is_greedy
    assert params.skip_special_tokens
    assert params.stop == ()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.1}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
        ({"min_p": -0.1}, "min_p"),
        ({"seed": 1.0}, "seed"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": [3]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"min_tokens": 17}, r"min_tokens must be an int in \[0, max_tokens=16\]"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"logprobs": 21}, r"logprobs must be None or an int in \[0, 20\]"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": 21}, r"prompt_logprobs must be None or an int in \[0, 20\]"),
        ({"prompt_logprobs": True}, "prompt_logprobs"),
        ({"skip_special_tokens": None}, "skip_special_tokens"),
    ],
)
def test_invalid_values_name_field_and_range(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)


def test_boundaries_accepted() -> None:
    SamplingParams(
        temperature=0.0, top_p=1.0, top_k=-1, min_p=1.0, presence_penalty=-2.0,
        frequency_penalty=2.0, min_tokens=16, logprobs=0, seed=0,
    )  # fmt: skip
    SamplingParams(top_k=0, logprobs=20, max_tokens=1, min_tokens=1)


def test_stop_normalised_to_tuples() -> None:
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    assert hash(SamplingParams(stop=["x"])) == hash(SamplingParams(stop=("x",)))


def test_greedy_and_from_dict() -> None:
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams.from_dict({"temperature": 0.5}).temperature == 0.5
    with pytest.raises(ValueError, match="unknown sampling parameter"):
        SamplingParams.from_dict({"temprature": 0.5})


def test_frozen() -> None:
    params = SamplingParams()
    with pytest.raises(AttributeError):
        params.temperature = 0.0
