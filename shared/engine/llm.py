"""The offline Python API, as vLLM's: `LLM(model).generate(prompts, SamplingParams(...))` returns
one `RequestOutput` per prompt, whose `outputs` are the prompt's `n` completions."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nori.engine import outputs as engine
from nori.engine.completion_outputs import RequestOutput, request_output
from nori.engine.config import EngineConfig, SpeculativeConfig
from nori.engine.engine import LLMEngine
from nori.engine.generate_progress import GenerateProgress
from nori.sampling.params import SamplingParams, choice_params

# A prompt as vLLM takes one: text, token ids, {"prompt": text} or {"prompt_token_ids": ids}.
Prompt = str | list[int] | Mapping[str, Any]
Conversation = Sequence[Mapping[str, Any]]
UseTqdm = bool | Callable[..., Any]


@dataclass(frozen=True)
class _Prompt:
    text: str | None  # what the output reports as its prompt: None for token ids, as vLLM
    token_ids: list[int]


class LLM:
    """Generates completions for a batch of prompts with continuous batching. Keyword arguments
    are EngineConfig fields; `speculative_config` may be a dict or JSON (ValueError pre-load)."""

    def __init__(
        self,
        model: str = "demo",
        speculative_config: SpeculativeConfig | Mapping[str, Any] | str | None = None,
        **engine_options: Any,
    ) -> None:
        speculative = _as_speculative_config(speculative_config)
        config = EngineConfig(model=model, speculative_config=speculative, **engine_options)
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Any:
        return self.engine.model.tokenizer

    def close(self) -> None:
        """Ends a tensor-parallel engine's other ranks (a no-op otherwise); also at exit."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: UseTqdm = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion: one output per prompt, in order, with
        `sampling_params.n` completions each. `priority`: one per prompt (lower first)."""
        batch = [self._prompt(prompt) for prompt in _as_prompt_list(prompts)]
        params = _as_params_list(sampling_params, len(batch))
        if priority is None:
            return self._generate(batch, params, use_tqdm)
        if len(priority) != len(batch):
            raise ValueError(f"{len(priority)} priorities for {len(batch)} prompts")
        return self._generate(batch, params, use_tqdm, list(priority))

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: UseTqdm = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Renders each conversation with the chat template, then generates; each output's
        `prompt` is the rendered text."""
        batch: list[Conversation]
        if messages and isinstance(messages[0], Mapping):
            batch = [list(messages)]  # type: ignore[arg-type]
        else:
            batch = [list(conversation) for conversation in messages]  # type: ignore[arg-type]
        tokenizer = self.engine.model.tokenizer
        prompts = []
        for conversation in batch:
            text = tokenizer.apply_chat_template(
                conversation,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
            )
            # Templates write their own BOS; encoding must not add a second one (as vLLM does).
            prompts.append(_Prompt(text, tokenizer.encode(text, add_special_tokens=False)))
        return self._generate(prompts, _as_params_list(sampling_params, len(batch)), use_tqdm)

    def _prompt(self, prompt: Prompt) -> _Prompt:
        if isinstance(prompt, Mapping):
            unknown = set(prompt) - {"prompt", "prompt_token_ids"}
            if unknown or len(prompt) != 1:
                raise ValueError(
                    "a prompt dict takes exactly one of 'prompt' and 'prompt_token_ids', "
                    f"got {sorted(prompt)}"
                )
            if "prompt_token_ids" in prompt:
                return _Prompt(None, list(prompt["prompt_token_ids"]))
            text = prompt["prompt"]
            if not isinstance(text, str):
                raise ValueError(f"a prompt dict's 'prompt' is text, got {text!r}")
            return _Prompt(text, self.engine.model.tokenizer.encode(text))
        if isinstance(prompt, str):
            return _Prompt(prompt, self.engine.model.tokenizer.encode(prompt))
        return _Prompt(None, list(prompt))

    def _generate(
        self,
        prompts: list[_Prompt],
        params: list[SamplingParams],
        use_tqdm: UseTqdm,
        priorities: list[int] | None = None,
    ) -> list[RequestOutput]:
        # A prompt's completions: one keeps its id, n of them are "{i}_{id}" (as vLLM).
        plan: list[tuple[str, list[str]]] = []
        added: list[str] = []
        priorities = priorities or [0] * len(prompts)
        try:
            for prompt, prompt_params, priority in zip(prompts, params, priorities, strict=True):
                request_id = f"offline-{next(self._ids)}"
                choices = choice_params(prompt_params, prompt_params.n)
                ids = (
                    [request_id]
                    if len(choices) == 1
                    else [f"{i}_{request_id}" for i in range(len(choices))]
                )
                plan.append((request_id, ids))
                for engine_id, choice in zip(ids, choices, strict=True):
                    self.engine.add_request(engine_id, prompt.token_ids, choice, priority=priority)
                    added.append(engine_id)
            finished = self._run(added, use_tqdm)
        finally:
            # On an error or Ctrl-C, leave no request holding blocks behind.
            for engine_id in added:
                self.engine.abort_request(engine_id)
        return [
            request_output(request_id, prompt.text, [finished[i] for i in ids], self._token_text)
            for (request_id, ids), prompt in zip(plan, prompts, strict=True)
        ]

    def _run(self, request_ids: list[str], use_tqdm: UseTqdm) -> dict[str, engine.StepOutput]:
        finished: dict[str, engine.StepOutput] = {}
        wanted = set(request_ids)
        with GenerateProgress(request_ids, use_tqdm) as progress:
            while self.engine.has_unfinished_requests():
                outputs = self.engine.step()
                for output in outputs:
                    if output.finished and output.request_id in wanted:
                        finished[output.request_id] = output
                progress.update(outputs)
        return finished

    def _token_text(self, token_id: int) -> str:
        # Decoded alone, as vLLM's `Logprob.decoded_token`: " the" rather than "Ġthe".
        return str(self.engine.model.tokenizer.decode([token_id], skip_special_tokens=False))


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, Mapping)):
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


def _as_speculative_config(
    value: SpeculativeConfig | Mapping[str, Any] | str | None,
) -> SpeculativeConfig | None:
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    return SpeculativeConfig.parse(dict(value) if isinstance(value, Mapping) else value)
