"""Request and response bodies of the OpenAI-compatible API (the subset Nori serves).

Requests take what OpenAI and vLLM take; unknown fields are ignored, as OpenAI does, and known
ones Nori cannot honour are refused in `prompts.py`. Validation is strict (no coercion; a 400
names the field): integers are bounded by their proto type (`Int32`), floats must be finite."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

# torch.Generator.manual_seed takes a signed or unsigned 64-bit value; keep to the signed range.
_SEED_MIN = -(2**63)
_SEED_MAX = 2**63 - 1
INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1

Int32 = Annotated[int, Field(ge=INT32_MIN, le=INT32_MAX)]

_REQUEST_CONFIG = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


def _lone_surrogate_path(value: Any, path: str) -> str | None:
    """Where a string in the body holds a lone surrogate (valid JSON, not UTF-8), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        found = _lone_surrogate_path(item, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


class _TextChecked(BaseModel):
    """A request body whose strings must all be valid Unicode text."""

    @model_validator(mode="before")
    @classmethod
    def _no_lone_surrogates(cls, data: Any) -> Any:
        path = _lone_surrogate_path(data, "")
        if path is not None:
            raise ValueError(f"{path} holds a lone UTF-16 surrogate, which is not valid text")
        return data


class StreamOptions(BaseModel):
    model_config = _REQUEST_CONFIG

    include_usage: bool = False


class SamplingFields(_TextChecked):
    """Fields shared by both endpoints."""

    model_config = _REQUEST_CONFIG

    # OpenAI requires `model`; vLLM (and Nori) default it to the served model.
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int32 | None = None
    min_p: float | None = None
    seed: int | None = Field(default=None, ge=_SEED_MIN, le=_SEED_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: Int32 = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM extension: logprob tokens as "token_id:123", exact even for partial UTF-8 bytes.
    return_tokens_as_token_ids: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Int32 = 1
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extension: lower is served first; batch lines carry nori.settings.BATCH_PRIORITY.
    priority: Int32 = 0


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: Int32 | None = 16
    logprobs: Int32 | None = None
    # With max_tokens 0, the prompt alone: how evaluation harnesses score a text (as vLLM).
    echo: bool = False
    suffix: str | None = None
    best_of: Int32 | None = None


class TextContentPart(BaseModel):
    model_config = _REQUEST_CONFIG

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # Extra keys (name, tool_call_id, ...) go to the chat template untouched, as in vLLM.
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    role: str
    content: str | list[TextContentPart | dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: Int32 | None = None
    # The newer OpenAI name; wins over `max_tokens` when both are given.
    max_completion_tokens: Int32 | None = None
    logprobs: bool = False
    top_logprobs: Int32 | None = None
    # Refused in prompts.py: tool calling is not served.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    # vLLM extensions.
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(_TextChecked):
    """vLLM's /tokenize: either a prompt, or chat messages rendered by the template."""

    model_config = _REQUEST_CONFIG

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = _REQUEST_CONFIG

    model: str | None = None
    tokens: list[int]


# ----------------------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    # None for an echoed prompt's first token, which nothing before it scores (as vLLM).
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # vLLM extension: the stop string or token id that ended the choice.
    stop_reason: str | int | None = None


class _Envelope(BaseModel):
    """What every response and streamed chunk starts with."""

    id: str
    created: int
    model: str


class CompletionResponse(_Envelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


# OpenAI streams a completion as chunks of the response's own shape.
CompletionChunk = CompletionResponse


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class _ChatChoiceEnd(BaseModel):
    """A chat choice's fields besides its message (whole) or delta (streamed)."""

    index: int
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatChoice(_ChatChoiceEnd):
    message: ChatResponseMessage


class ChatCompletionResponse(_Envelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="plain")
    def _present_fields_only(self) -> dict[str, str]:
        # OpenAI's deltas carry only what changed ({} on a chunk with only finish_reason).
        fields = {"role": self.role, "content": self.content}
        return {key: value for key, value in fields.items() if value is not None}


class ChatStreamChoice(_ChatChoiceEnd):
    delta: ChatDelta


class ChatCompletionChunk(_Envelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "nori"
    root: str
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str
