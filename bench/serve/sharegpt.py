"""ShareGPT conversations as requests: the first human turn is the prompt, and the token length
of the answer that follows it is the request's max_tokens.

The filters are vLLM's (`is_valid_sequence`): prompts or answers under 4 tokens say little
about serving and are dropped, and so are prompts over 1024 tokens or pairs over 2048 tokens
in all; with --max-model-len, also pairs the server could not hold. One difference: the
answer's length is counted without special tokens (vLLM counts a BOS in it), since the answer is
generated text, not a prompt.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from nori.bench.serve.prompts import PromptMaker
from nori.bench.serve.specs import RequestSpec

MIN_LEN = 4
MAX_PROMPT_LEN = 1024
MAX_TOTAL_LEN = 2048
_HUMAN = frozenset({"human", "user"})
_ASSISTANT = frozenset({"gpt", "chatgpt", "assistant"})


def first_exchange(entry: object) -> tuple[str, str] | None:
    """(first human turn, the assistant answer right after it), or None when there is none."""
    if not isinstance(entry, dict):
        return None
    turns = entry.get("conversations")
    if not isinstance(turns, list):
        return None
    for index, turn in enumerate(turns):
        if isinstance(turn, dict) and turn.get("from") in _HUMAN:
            answer = turns[index + 1] if index + 1 < len(turns) else None
            if not isinstance(answer, dict) or answer.get("from") not in _ASSISTANT:
                return None
            prompt, reply = turn.get("value"), answer.get("value")
            if isinstance(prompt, str) and isinstance(reply, str):
                return prompt, reply
            return None
    return None


def read_exchanges(path: str | Path) -> list[tuple[str, str]]:
    """Every conversation's first exchange (human turn, answer), in the file's order."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read the ShareGPT file {path}: {error}") from error
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file holds a JSON list of conversations")
    return [pair for entry in data if (pair := first_exchange(entry)) is not None]


def keep(prompt_len: int, output_len: int, max_model_len: int | None) -> bool:
    if prompt_len < MIN_LEN or output_len < MIN_LEN:
        return False
    if prompt_len > MAX_PROMPT_LEN or prompt_len + output_len > MAX_TOTAL_LEN:
        return False
    return max_model_len is None or prompt_len + output_len <= max_model_len


def sharegpt_requests(
    path: str | Path,
    maker: PromptMaker,
    rng: np.random.Generator,
    count: int,
    max_model_len: int | None = None,
) -> list[RequestSpec]:
    """`count` requests from a seeded shuffle of the file; the kept ones are repeated in turn
    when the file has fewer (vLLM oversamples the same way)."""
    pairs = read_exchanges(path)
    chosen: list[RequestSpec] = []
    # Tokenizes lazily, in shuffled order, only until enough requests are kept.
    for position in rng.permutation(len(pairs)):
        prompt_text, answer = pairs[int(position)]
        prompt = maker.from_text(prompt_text)
        output_len = len(maker.tokenizer.encode(answer, add_special_tokens=False))
        if keep(prompt.length, output_len, max_model_len):
            chosen.append(RequestSpec(prompt.value, prompt.length, output_len, "sharegpt"))
            if len(chosen) == count:
                break
    if not chosen:
        raise ValueError(f"no conversation in {path} passes the ShareGPT length filters")
    return [chosen[index % len(chosen)] for index in range(count)]
