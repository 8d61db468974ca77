"""Renders Hugging Face chat templates the way transformers does.

The environment mirrors `transformers.utils.chat_template_utils._compile_jinja_template`: an
immutable sandbox (templates come from model repositories, so they are untrusted code),
`trim_blocks`/`lstrip_blocks` on (templates are written assuming them), the `loopcontrols`
extension, a `tojson` filter that keeps non-ASCII text as is, and the `raise_exception` and
`strftime_now` globals. Templates rendered here then produce byte-identical prompts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """A template is missing, malformed, or rejected the conversation (`raise_exception`)."""


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters and sorts keys; transformers replaces it with
    # plain json.dumps, and prompts must match what the model was trained on.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    """Compiles once per distinct template text; compiling costs far more than rendering."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as error:
        raise ChatTemplateError(f"chat template does not compile: {error}") from error


def select_template(raw: object, name: str | None = None) -> str | None:
    """Picks one template from tokenizer_config's `chat_template` (a string or named list)."""
    if raw is None or isinstance(raw, str):
        if name not in (None, "default") and raw is not None:
            raise ChatTemplateError(f"no chat template named {name!r}; only a default exists")
        return raw
    if isinstance(raw, list):
        templates = {
            entry["name"]: entry["template"]
            for entry in raw
            if isinstance(entry, dict) and "name" in entry and "template" in entry
        }
        wanted = name or "default"
        if wanted not in templates:
            raise ChatTemplateError(
                f"no chat template named {wanted!r}; available: {sorted(templates)}"
            )
        return templates[wanted]
    raise ChatTemplateError(f"chat_template must be a string or a list, got {type(raw).__name__}")


def render_chat_template(
    source: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool,
    special_tokens: Mapping[str, str | None],
    extra: Mapping[str, Any] | None = None,
) -> str:
    """Renders `messages` with the variables transformers passes (special tokens, flags)."""
    variables: dict[str, Any] = dict(special_tokens)
    variables.update(extra or {})
    variables["messages"] = [dict(message) for message in messages]
    variables["add_generation_prompt"] = add_generation_prompt
    try:
        return compile_template(source).render(**variables)
    except jinja2.TemplateError as error:
        raise ChatTemplateError(f"chat template failed to render: {error}") from error


def load_chat_template(value: str) -> str:
    """`--chat-template`: a file holding a Jinja template, or the template itself (as vLLM).

    A value that names no file and has no template syntax is taken for a mistyped path.
    """
    try:
        is_file = Path(value).expanduser().is_file()
    except OSError:  # a template is no file name (too long, say)
        is_file = False
    if is_file:
        return Path(value).expanduser().read_text()
    if any(mark in value for mark in ("{{", "{%", "\n")):
        return value
    raise ChatTemplateError(
        f"--chat-template {value!r}: no such file, and not a Jinja template either"
    )
