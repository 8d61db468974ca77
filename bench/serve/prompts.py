"""Prompts of a chosen token length, made of random vocabulary.

Lengths count what the server will count: a text prompt's `tokenizer.encode(text)` with its
special tokens (the BOS a completions endpoint adds), a token-id prompt's ids as sent. Token-id
prompts are exact by construction: the special ids, then random ids. Text prompts are decoded
from random ids and re-encoded, since N ids seldom decode to a text that encodes back to N ids
(a word can split, or neighbours merge); the re-encoded ids are trimmed or extended and the
round trip repeated until the length is right, as vLLM's random dataset does. Random ids are
drawn from the tokens that decode to clean text on their own and encode back to themselves,
which makes that loop converge in one or two rounds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nori.sampling.tokenizer import Tokenizer

# Decode/re-encode rounds before settling for the closest text.
_MAX_ROUNDS = 10
# Fresh random suffixes tried before accepting one that changes the last prefix token.
_MAX_SUFFIX_ATTEMPTS = 8


@dataclass(frozen=True)
class Prompt:
    """What is sent (text or token ids) and the token ids the server will see."""

    value: str | tuple[int, ...]
    ids: tuple[int, ...]

    @property
    def length(self) -> int:
        return len(self.ids)


@dataclass(frozen=True, eq=False)
class PromptMaker:
    tokenizer: Tokenizer
    token_ids: bool
    # Ids random prompts are made of.
    pool: tuple[int, ...]
    # What encoding adds to any text (BOS); a token-id prompt starts with them.
    special_ids: tuple[int, ...]

    @classmethod
    def create(cls, tokenizer: Tokenizer, prompt_format: str) -> PromptMaker:
        return cls(
            tokenizer=tokenizer,
            token_ids=prompt_format == "token-ids",
            pool=clean_token_pool(tokenizer),
            special_ids=tuple(tokenizer.encode("")),
        )

    @property
    def min_length(self) -> int:
        """The shortest prompt: the special ids and one real token."""
        return len(self.special_ids) + 1

    def random_ids(self, rng: np.random.Generator, count: int) -> list[int]:
        if count <= 0:
            return []
        picks = rng.integers(0, len(self.pool), size=count)
        return [self.pool[i] for i in picks]

    def random_prompt(self, rng: np.random.Generator, length: int) -> Prompt:
        """A whole prompt of `length` tokens, special tokens included."""
        body = max(1, length - len(self.special_ids))
        if self.token_ids:
            ids = (*self.special_ids, *self.random_ids(rng, body))
            return Prompt(ids, ids)
        text = self._fit_text(rng, self.random_ids(rng, body), body)
        return self.from_text(text)

    def extend(self, rng: np.random.Generator, head: Prompt, count: int) -> Prompt:
        """`head` followed by `count` random tokens; the head's own tokens stay unchanged."""
        if self.token_ids:
            ids = (*head.ids, *self.random_ids(rng, count))
            return Prompt(ids, ids)
        assert isinstance(head.value, str)
        prompt = head
        for _ in range(_MAX_SUFFIX_ATTEMPTS):
            suffix = self._fit_text(rng, self.random_ids(rng, count), count)
            prompt = self.from_text(head.value + suffix)
            # In text, the suffix's first characters can merge with the head's last token.
            if prompt.ids[: head.length] == head.ids and prompt.length == head.length + count:
                return prompt
        return prompt

    def from_text(self, text: str) -> Prompt:
        ids = tuple(self.tokenizer.encode(text))
        return Prompt(ids if self.token_ids else text, ids)

    def _fit_text(self, rng: np.random.Generator, ids: list[int], count: int) -> str:
        """A text whose encoding has `count` tokens besides the special ones."""
        text = self.tokenizer.decode(ids)
        for _ in range(_MAX_ROUNDS):
            encoded = self.tokenizer.encode(text, add_special_tokens=False)
            excess = len(encoded) - count
            if excess == 0:
                break
            ids = encoded[:count] if excess > 0 else encoded + self.random_ids(rng, -excess)
            text = self.tokenizer.decode(ids)
        return text


def clean_token_pool(tokenizer: Tokenizer) -> tuple[int, ...]:
    """Ids that are not special, decode to text without replacement characters (a lone byte
    of a multi-byte character), and encode back to themselves."""
    special = tokenizer.special_token_ids
    pool = []
    for token_id in range(tokenizer.vocab_size):
        if token_id in special:
            continue
        text = tokenizer.decode([token_id])
        if text and "\ufffd" not in text and tokenizer.encode(text, False) == [token_id]:
            pool.append(token_id)
    if pool:
        return tuple(pool)
    # A tokenizer where no token round-trips alone: any non-special id will do, the
    # decode/re-encode loop copes.
    return tuple(i for i in range(tokenizer.vocab_size) if i not in special)
