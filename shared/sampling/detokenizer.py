"""Streaming detokenization of one request's output, with stop strings.

vLLM's two-offset scheme, so everything emitted, concatenated, equals `Tokenizer.decode` of the
same ids: text is held back while the newest token is a byte-fallback piece, and while the
decoded window ends in U+FFFD; `flush()` releases it when the request ends. Byte-level BPE
tokenizers (no byte-fallback pieces) run the scheme in tokenizers' `DecodeStream`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from tokenizers.decoders import DecodeStream

from nori.sampling.params import SamplingParams
from nori.sampling.stop_strings import find_stop
from nori.sampling.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded in front of the output (as vLLM) so the first token keeps its space.
_CONTEXT_TOKENS = 6
_MAX_CONTEXT_TOKENS = 24


class DetokenizeResult(NamedTuple):
    new_text: str  # text safe to stream now
    stop_string: str | None = None  # set once a stop string ended the request

    @property
    def stopped(self) -> bool:
        return self.stop_string is not None


class IncrementalDetokenizer:
    """Turns one request's sampled tokens into streamed text and detects stop strings.

    `text` is the whole output so far (cut at a found stop string); a result's `new_text` is the
    part safe to show; a possible stop-string prefix is held unless `include_stop_str_in_output`."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        params: SamplingParams,
        prompt_token_ids: Sequence[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._backend = tokenizer.backend
        self._backend_decode = tokenizer.backend.decode
        self._skip_special = params.skip_special_tokens
        self._stops = params.stop
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._hold_chars = (
            max(len(s) for s in self._stops) - 1 if self._stops and not self._include_stop else 0
        )
        self._byte_ids = tokenizer.byte_fallback_ids
        self._invisible_ids = tokenizer.special_token_ids if self._skip_special else frozenset()
        self._in_byte_run = False

        context = self._choose_context(prompt_token_ids)
        self._ids: list[int] = list(context)
        self._prefix_offset = 0  # window start: decoded again each step for the diff
        self._read_offset = len(context)  # tokens before this are already in `_text`
        self._text = ""
        self._emitted = 0  # chars of `_text` already returned to the caller
        self._num_tokens = 0
        self._stop_floor = 0
        self._stop_string: str | None = None
        self._stream: DecodeStream | None = None
        if not self._byte_ids:
            self._stream = DecodeStream(skip_special_tokens=self._skip_special)
            for token_id in context:  # primes it: the first token keeps its space
                self._stream.step(tokenizer.backend, token_id)

    def _choose_context(self, prompt: Sequence[int]) -> list[int]:
        # The context must start on a clean boundary (no byte run, no U+FFFD).
        if not prompt:
            return []
        for size in range(
            min(_CONTEXT_TOKENS, len(prompt)), min(_MAX_CONTEXT_TOKENS, len(prompt)) + 1
        ):
            suffix = list(prompt[-size:])
            if suffix[0] in self._byte_ids:
                continue
            if REPLACEMENT_CHAR not in self._decode(suffix):
                return suffix
        return []

    def _decode(self, ids: list[int]) -> str:
        # The backend's own call (Tokenizer.decode's, without its copy of `ids`).
        return str(self._backend_decode(ids, skip_special_tokens=self._skip_special))

    @property
    def text(self) -> str:
        return self._text

    @property
    def stop_string(self) -> str | None:
        return self._stop_string

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def add_token(self, token_id: int) -> DetokenizeResult:
        if self._stop_string is not None:
            raise RuntimeError("add_token after the request stopped on a stop string")
        self._ids.append(token_id)
        self._num_tokens += 1
        if self._stream is not None:
            new_chars = self._stream.step(self._backend, token_id) or ""
        else:
            if token_id not in self._invisible_ids:
                self._in_byte_run = token_id in self._byte_ids
            new_chars = "" if self._in_byte_run else self._advance(final=False)
        if not self._stops:  # nothing held back: all of it is safe now
            self._text += new_chars
            self._emitted = len(self._text)
            return DetokenizeResult(new_chars)
        return self._after_new_text(new_chars, final=False)

    def flush(self) -> DetokenizeResult:
        """Call once when the request ends otherwise; returns all withheld text."""
        if self._stop_string is not None:
            return DetokenizeResult("", self._stop_string)
        return self._after_new_text(self._advance(final=True), final=True)

    def _advance(self, final: bool) -> str:
        decode, skip, ids = self._backend_decode, self._skip_special, self._ids
        if self._stream is not None:  # at the end: what the stream holds back, if anything
            output: str = decode(ids, skip_special_tokens=skip)
            context: str = decode(ids[: self._read_offset], skip_special_tokens=skip)
            return output[len(context) + len(self._text) :]
        full: str = decode(ids[self._prefix_offset :], skip_special_tokens=skip)
        if not final and full.endswith(REPLACEMENT_CHAR):
            return ""  # a character is split across tokens; wait for the rest
        prefix: str = decode(ids[self._prefix_offset : self._read_offset], skip_special_tokens=skip)
        if len(full) <= len(prefix):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full[len(prefix) :]

    def _after_new_text(self, new_chars: str, final: bool) -> DetokenizeResult:
        self._text += new_chars
        if self._stops:
            if self._num_tokens <= self._min_tokens:
                # vLLM ignores stop strings inside the first min_tokens tokens' text.
                self._stop_floor = len(self._text)
            else:
                match = find_stop(self._text, len(new_chars), self._stops, self._stop_floor)
                if match is not None:
                    end = match.index + (len(match.stop) if self._include_stop else 0)
                    # Never cut below what was streamed already.
                    self._text = self._text[: max(end, self._emitted)]
                    self._stop_string = match.stop
                    return DetokenizeResult(self._take(len(self._text)), match.stop)
        safe_end = len(self._text) if final else len(self._text) - self._hold_chars
        return DetokenizeResult(self._take(safe_end))

    def _take(self, end: int) -> str:
        if end <= self._emitted:
            return ""
        chunk = self._text[self._emitted : end]
        self._emitted = end
        return chunk
