"""What every prompt must be before the engine takes it."""

from __future__ import annotations

from collections.abc import Sequence


def validate_prompt(prompt_ids: Sequence[int], vocab_size: int, max_model_len: int) -> None:
    """Raises ValueError, saying why, for a prompt the engine can never serve."""
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids out of range [0, {vocab_size}): {bad[:5]}")
    if len(prompt_ids) >= max_model_len:
        raise ValueError(
            f"the prompt has {len(prompt_ids)} tokens; this model accepts at most "
            f"{max_model_len - 1} (max_model_len {max_model_len} includes the output)"
        )
