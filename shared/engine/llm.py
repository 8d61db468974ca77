"""The offline Python API: `LLM(model).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from nori.engine.config import EngineConfig
from nori.engine.engine import LLMEngine
from nori.engine.outputs import RequestOutput
from nori.sampling.params import SamplingParams

Prompt = str | list[int]


class LLM:
    """Generates completions for a batch of prompts with continuous batching.

    Keyword arguments are EngineConfig fields (block_size, max_num_seqs, num_kv_blocks, ...).
    """

    def __init__(self, model: str = "demo", **engine_options: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in the prompts' order."""
        batch = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(batch))
        request_ids = [f"offline-{next(self._ids)}" for _ in batch]
        added: list[str] = []
        try:
            for request_id, prompt, request_params in zip(request_ids, batch, params, strict=True):
                self.engine.add_request(request_id, prompt, request_params)
                added.append(request_id)
            return self._run(request_ids, use_tqdm)
        finally:
            # On an error or Ctrl-C, leave no request holding blocks behind.
            for request_id in added:
                self.engine.abort_request(request_id)

    def chat(
        self,
        conversations: list[dict[str, str]] | Sequence[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Applies the model's chat template to each conversation, then generates."""
        batch: list[list[dict[str, str]]]
        if conversations and isinstance(conversations[0], dict):
            batch = [list(conversations)]  # type: ignore[arg-type]
        else:
            batch = [list(c) for c in conversations]  # type: ignore[arg-type]
        # Templates write their own BOS; encoding must not add a second one (as vLLM does).
        tokenizer = self.engine.tokenizer
        prompts: list[Prompt] = [
            tokenizer.encode(
                tokenizer.apply_chat_template(messages, add_generation_prompt=True),
                add_special_tokens=False,
            )
            for messages in batch
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        with tqdm(total=len(request_ids), disable=not use_tqdm, unit="req") as progress:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished and output.request_id in wanted:
                        finished[output.request_id] = output
                        progress.update(1)
        return [finished[request_id] for request_id in request_ids]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(p, int) for p in items):
        return [items]  # type: ignore[list-item]
    return items  # type: ignore[return-value]


def _as_params_list(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    items = list(params)
    if len(items) != count:
        raise ValueError(f"{len(items)} sampling params for {count} prompts")
    return items
