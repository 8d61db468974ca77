"""The progress bar of `LLM.generate`, as vLLM's: completions done, and the input and output
token speeds so far in the postfix."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from tqdm import tqdm

from nori.engine.outputs import StepOutput

# The postfix follows the tokens at most this often when no request finishes.
_REFRESH_S = 0.5


class GenerateProgress:
    """Fed every engine step's outputs; counts only the requests it was made for."""

    def __init__(
        self, request_ids: Iterable[str], use_tqdm: bool | Callable[..., Any] = True
    ) -> None:
        self._wanted = set(request_ids)
        self._input_tokens = 0
        self._output_tokens = 0
        self._start = self._refreshed = time.perf_counter()
        self._bar: Any = None
        if use_tqdm:
            # A callable is used as the tqdm class (vLLM accepts one too).
            factory = use_tqdm if callable(use_tqdm) else tqdm
            self._bar = factory(
                total=len(self._wanted),
                desc="Processed prompts",
                dynamic_ncols=True,
                postfix=self._speeds(1.0),
            )

    def __enter__(self) -> GenerateProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.close()

    def update(self, outputs: Iterable[StepOutput]) -> None:
        if self._bar is None:
            return
        done = 0
        for output in outputs:
            if output.request_id not in self._wanted:
                continue
            self._output_tokens += len(output.new_token_ids)
            if output.finished:
                done += 1
                self._input_tokens += len(output.prompt_token_ids)
        now = time.perf_counter()
        if done or now - self._refreshed >= _REFRESH_S:
            self._refreshed = now
            self._bar.set_postfix_str(self._speeds(now - self._start), refresh=False)
            if done:
                self._bar.update(done)
            else:
                self._bar.refresh()

    def _speeds(self, elapsed: float) -> str:
        elapsed = max(elapsed, 1e-9)
        return (
            f"est. speed input: {self._input_tokens / elapsed:.2f} toks/s, "
            f"output: {self._output_tokens / elapsed:.2f} toks/s"
        )
