from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nori.sampling.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from nori.sampling.params import SamplingParams
from nori.sampling.tokenizer import Tokenizer
from tests.sampling.helpers import STORIES_DIR, build_byte_level_dir

STORIES = Tokenizer.from_dir(STORIES_DIR) if (STORIES_DIR / "tokenizer.json").is_file() else None
needs_stories = pytest.mark.skipif(
    STORIES is None, reason=f"stories260K checkpoint not found at {STORIES_DIR}"
)


def stream(
    tok: Tokenizer,
    ids: list[int],
    params: SamplingParams | None = None,
    prompt: list[int] | None = None,
) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok, params or SamplingParams(), prompt or [])
    chunks = []
    for token in ids:
        result = detok.add_token(token)
        chunks.append(result.new_text)
        if result.stopped:
            return chunks, detok
    chunks.append(detok.flush().new_text)
    return chunks, detok


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(build_byte_level_dir(tmp_path_factory.mktemp("bl")))


# Random ids, biased towards byte-fallback pieces (3..258) and special tokens (0..2), where
# streaming is hard: partial characters, invalid byte runs, special tokens inside byte runs.
stories_ids = st.lists(
    st.one_of(st.integers(0, 511), st.integers(0, 258), st.integers(3, 258)), max_size=24
)


@needs_stories
@settings(max_examples=400, deadline=None)
@given(ids=stories_ids, skip=st.booleans())
def test_stream_concatenation_equals_full_decode_stories(ids: list[int], skip: bool) -> None:
    assert STORIES is not None
    chunks, detok = stream(STORIES, ids, SamplingParams(skip_special_tokens=skip))
    full = STORIES.decode(ids, skip_special_tokens=skip)
    assert "".join(chunks) == full
    assert detok.text == full


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data(), skip=st.booleans())
def test_stream_concatenation_equals_full_decode_byte_level(
    byte_level: Tokenizer, data: st.DataObject, skip: bool
) -> None:
    ids = data.draw(st.lists(st.integers(0, byte_level.vocab_size - 1), max_size=24))
    chunks, _ = stream(byte_level, ids, SamplingParams(skip_special_tokens=skip))
    assert "".join(chunks) == byte_level.decode(ids, skip_special_tokens=skip)


@needs_stories
def test_no_split_characters_streamed_through_byte_fallback() -> None:
    assert STORIES is not None
    text = "Lily saw 😀🎉 and 中文字符 — naïve café"
    ids = STORIES.encode(text, add_special_tokens=False)
    assert any(i in STORIES.byte_fallback_ids for i in ids)
    chunks, _ = stream(STORIES, ids)
    assert REPLACEMENT_CHAR not in STORIES.decode(ids)
    assert all(REPLACEMENT_CHAR not in chunk for chunk in chunks)
    assert "".join(chunks) == text
    assert "😀🎉" in "".join(chunks[:-1])  # released before flush, once the byte run ended


def test_no_split_characters_byte_level(byte_level: Tokenizer) -> None:
    text = "emoji 😀🎉 中文字符 Ünïcödé"
    ids = byte_level.encode(text, add_special_tokens=False)
    chunks, _ = stream(byte_level, ids)
    assert all(REPLACEMENT_CHAR not in chunk for chunk in chunks)
    assert "".join(chunks) == text


def test_stop_string_spanning_tokens_is_cut(byte_level: Tokenizer) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    ids = byte_level.encode(text, add_special_tokens=False)
    assert not any(byte_level.decode([i]) == "fox" for i in ids)  # really spans tokens
    chunks, detok = stream(byte_level, ids, SamplingParams(stop=["own fox j"]))
    assert detok.stop_string == "own fox j"
    assert detok.text == "The quick br"
    assert "".join(chunks) == "The quick br"


def test_stop_string_included_when_asked(byte_level: Tokenizer) -> None:
    ids = byte_level.encode("The quick brown fox jumps", add_special_tokens=False)
    params = SamplingParams(stop=["own f"], include_stop_str_in_output=True)
    chunks, detok = stream(byte_level, ids, params)
    assert detok.text == "The quick brown f"
    assert "".join(chunks) == "The quick brown f"


def test_earliest_stop_wins(byte_level: Tokenizer) -> None:
    ids = byte_level.encode("The quick brown fox jumps", add_special_tokens=False)
    _, detok = stream(byte_level, ids, SamplingParams(stop=["fox", "quick b", "nothing"]))
    assert detok.stop_string == "quick b"
    assert detok.text == "The "


def test_hold_back_never_streams_stop_prefix(byte_level: Tokenizer) -> None:
    # Partial stop matches ("o", "ov") must be withheld until they turn out not to stop.
    text = "ooo ov over! ovex overt"
    ids = byte_level.encode(text, add_special_tokens=False)
    params = SamplingParams(stop=["overt"])
    detok = IncrementalDetokenizer(byte_level, params)
    streamed = ""
    for token in ids:
        result = detok.add_token(token)
        streamed += result.new_text
        if result.stopped:
            break
        # exactly len("overt") - 1 characters withheld at every step
        assert len(detok.text) - len(streamed) == min(4, len(detok.text))
    assert detok.stop_string == "overt"
    assert streamed == "ooo ov over! ovex "
    assert detok.text == streamed


def test_hold_back_released_on_flush(byte_level: Tokenizer) -> None:
    ids = byte_level.encode("all good ov", add_special_tokens=False)
    chunks, detok = stream(byte_level, ids, SamplingParams(stop=["overt"]))
    assert not chunks[-2].endswith("ov")
    assert chunks[-1].endswith("ov")
    assert "".join(chunks) == "all good ov"
    assert detok.stop_string is None


def test_stop_strings_ignored_within_min_tokens(byte_level: Tokenizer) -> None:
    ids = byte_level.encode("fox fox fox", add_special_tokens=False)
    first_fox_tokens = len(byte_level.encode("fox", add_special_tokens=False))
    params = SamplingParams(stop=["fox"], min_tokens=first_fox_tokens)
    _, detok = stream(byte_level, ids, params)
    assert detok.stop_string == "fox"
    assert detok.text == "fox "


def test_add_after_stop_is_an_error(byte_level: Tokenizer) -> None:
    ids = byte_level.encode("ab ab", add_special_tokens=False)
    _, detok = stream(byte_level, ids, SamplingParams(stop=["a"]))
    with pytest.raises(RuntimeError):
        detok.add_token(ids[0])
    assert detok.flush().stop_string == "a"


@needs_stories
def test_prompt_context_keeps_leading_space() -> None:
    assert STORIES is not None
    prompt = STORIES.encode("Once upon a time")
    output = STORIES.encode(" there was a dog", add_special_tokens=False)
    _, detok = stream(STORIES, output, prompt=prompt)
    assert detok.text == " there was a dog"
    plain, _ = stream(STORIES, output)
    assert "".join(plain) == STORIES.decode(output) == "there was a dog"


def test_prompt_context_keeps_leading_space_byte_level(byte_level: Tokenizer) -> None:
    prompt = byte_level.encode("Once upon a time", add_special_tokens=False)
    output = byte_level.encode(" there was a dog 😀", add_special_tokens=False)
    chunks, detok = stream(byte_level, output, prompt=prompt)
    assert detok.text == "".join(chunks) == " there was a dog 😀"
