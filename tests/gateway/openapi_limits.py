"""The gateway's OpenAPI schema with the limits it enforces in code written into it.

FastAPI derives the schema from the pydantic models, which state types only. Ranges such as
`top_p` in (0, 1], a role the chat template knows, token ids inside the vocabulary, or "either
`prompt` or `messages`" are checked in request_params.py, prompts.py, tokenize.py and
SamplingParams; a body that breaks one is a 400 before any worker sees it. Fuzzing the schema as
served exercises those refusals; fuzzing this copy gets bodies through them to the workers.

Texts and outputs are kept short so that every request fits a 64-token context
(`MAX_MODEL_LEN`) and costs a CPU little: a byte-level tokenizer makes at most one token of
each UTF-8 byte, so 4 characters are at most 16 tokens.
"""

from __future__ import annotations

import copy
from typing import Any

# The workers' and the gateway's --max-model-len in the fuzzing cluster.
MAX_MODEL_LEN = 64
# At most 8 generated tokens a choice, at most 2 choices.
MAX_OUTPUT_TOKENS = 8

Schema = dict[str, Any]
NULL: Schema = {"type": "null"}


def _nullable(schema: Schema) -> Schema:
    return {"anyOf": [schema, NULL]}


def _number(low: float, high: float, exclusive_low: bool = False) -> Schema:
    bound = "exclusiveMinimum" if exclusive_low else "minimum"
    return {"type": "number", bound: low, "maximum": high}


def _integer(low: int, high: int) -> Schema:
    return {"type": "integer", "minimum": low, "maximum": high}


def _text(max_length: int, min_length: int = 0) -> Schema:
    return {"type": "string", "minLength": min_length, "maxLength": max_length}


def _array(items: Schema, max_items: int, min_items: int = 0) -> Schema:
    return {"type": "array", "items": items, "minItems": min_items, "maxItems": max_items}


def _messages() -> Schema:
    # Worst case 2 x (role + "\n" + 16 bytes + <|end|> + "\n") + BOS + "<|assistant|>\n": 43
    # tokens, and 8 generated ones still fit 64.
    text_part = {
        "type": "object",
        "properties": {"type": {"const": "text"}, "text": _text(1)},
        "required": ["type", "text"],
        "additionalProperties": False,
    }
    message = {
        "type": "object",
        "properties": {
            "role": {"enum": ["system", "user", "assistant"]},
            "content": {"anyOf": [_text(4), _array(text_part, 2), NULL]},
        },
        "required": ["role"],
        "additionalProperties": False,
    }
    return _array(message, 2, min_items=1)


def _sampling(vocab_size: int) -> dict[str, Schema]:
    """Fields both completion endpoints share (SamplingParams' and check_common's limits)."""
    token = _integer(0, vocab_size - 1)
    stop_text = _text(4, min_length=1)
    return {
        "temperature": _nullable(_number(0, 2)),
        "top_p": _nullable(_number(0, 1, exclusive_low=True)),
        "top_k": _nullable(_integer(-1, 20)),
        "min_p": _nullable(_number(0, 1)),
        "seed": _nullable(_integer(0, 2**32)),
        "stop": _nullable({"anyOf": [stop_text, _array(stop_text, 2)]}),
        "stop_token_ids": _nullable(_array(token, 2)),
        "presence_penalty": _nullable(_number(-2, 2)),
        "frequency_penalty": _nullable(_number(-2, 2)),
        # request_params.MIN_REPETITION_PENALTY: below it, logits blow up.
        "repetition_penalty": _nullable(_number(0.01, 2)),
        # At most max_tokens, which is at least 1.
        "min_tokens": _integer(0, 1),
        "n": _integer(1, 2),
        # Allowed only with stream: true; refused outright.
        "stream_options": NULL,
        "logit_bias": NULL,
        "user": _nullable(_text(4)),
    }


def _completion(vocab_size: int) -> dict[str, Schema]:
    tokens = _array(_integer(0, vocab_size - 1), 16, min_items=1)
    prompt_text = _text(4, min_length=1)
    return {
        "prompt": {
            "anyOf": [
                prompt_text,
                _array(prompt_text, 2, min_items=1),
                tokens,
                _array(tokens, 2, min_items=1),
            ]
        },
        # Not nullable: null means "all the room the context leaves".
        "max_tokens": _integer(1, MAX_OUTPUT_TOKENS),
        "logprobs": _nullable(_integer(0, 5)),
        # Refused by the gateway (not implemented).
        "suffix": NULL,
        "best_of": _nullable(_integer(1, 1)),
    }


def _chat() -> dict[str, Schema]:
    return {
        "messages": _messages(),
        "max_tokens": _integer(1, MAX_OUTPUT_TOKENS),
        "max_completion_tokens": _nullable(_integer(1, MAX_OUTPUT_TOKENS)),
        # Only with logprobs: true.
        "top_logprobs": NULL,
        "tools": NULL,
        "tool_choice": _nullable({"enum": ["none", "auto"]}),
        "response_format": _nullable(
            {"type": "object", "properties": {"type": {"const": "text"}}, "required": ["type"]}
        ),
        # The model's own template: custom templates are fuzzed through the served schema.
        "chat_template": NULL,
        "chat_template_kwargs": NULL,
    }


def _restrict(component: Schema, properties: dict[str, Schema], required: list[str]) -> Schema:
    restricted = copy.deepcopy(component)
    restricted["properties"].update(properties)
    restricted["required"] = sorted({*restricted.get("required", ()), *required})
    return restricted


def with_enforced_limits(served: Schema, vocab_size: int) -> Schema:
    """A copy of the served OpenAPI schema whose request bodies pass the gateway's checks."""
    schema = copy.deepcopy(served)
    components = schema["components"]["schemas"]
    components["CompletionRequest"] = _restrict(
        components["CompletionRequest"],
        {**_sampling(vocab_size), **_completion(vocab_size)},
        ["max_tokens"],
    )
    components["ChatCompletionRequest"] = _restrict(
        components["ChatCompletionRequest"], {**_sampling(vocab_size), **_chat()}, ["max_tokens"]
    )
    # Exactly one of `prompt` and `messages`.
    tokenize = components["TokenizeRequest"]
    template = {"chat_template": NULL, "chat_template_kwargs": NULL}
    components["TokenizeRequest"] = {
        "anyOf": [
            _restrict(tokenize, {"prompt": _text(64), "messages": NULL}, ["prompt"]),
            _restrict(
                tokenize, {"messages": _messages(), "prompt": NULL, **template}, ["messages"]
            ),
        ]
    }
    components["DetokenizeRequest"] = _restrict(
        components["DetokenizeRequest"],
        {"tokens": _array(_integer(0, vocab_size - 1), 32)},
        ["tokens"],
    )
    return schema
