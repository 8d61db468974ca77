"""A model folder's tokenizer: encode, decode, special ids and the chat template.

Wraps `tokenizers.Tokenizer` and reads the Hugging Face side files as transformers does, so
prompts get `AutoTokenizer.from_pretrained(path)`'s ids. As transformers 5.x, tokenizer.json's
post-processor is applied as stored: `add_bos_token` is only reported, never acted on."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import tokenizers

from nori.sampling.chat_template import (
    ChatTemplateError,
    TemplateLimits,
    render_chat_template,
    select_template,
)

_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")

# Texts longer than this are encoded without holding the GIL (see Tokenizer.encode).
LONG_TEXT_CHARS = 32 * 1024


class TokenizerLoadError(ValueError):
    """A model folder lacks a usable tokenizer, or one of its files is malformed."""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise TokenizerLoadError(f"cannot read {path}: {error}") from error
    if not isinstance(data, dict):
        raise TokenizerLoadError(f"{path} must hold a JSON object")
    return data


def _token_content(value: object) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _as_id_list(value: object) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def chat_template_of(folder: Path, config: dict[str, Any] | None = None) -> str | None:
    """The folder's default chat template: `chat_template.jinja`, else tokenizer_config's
    `chat_template` (`config`: that file, already read); None where it has none."""
    template_file = folder / "chat_template.jinja"
    if template_file.is_file():
        return template_file.read_text(encoding="utf-8")
    if config is None:
        config = _read_json(folder / "tokenizer_config.json")
    try:
        return select_template(config.get("chat_template"))
    except ChatTemplateError as error:
        raise TokenizerLoadError(f"{folder / 'tokenizer_config.json'}: {error}") from error


# eq=False: comparing two Rust tokenizers field by field means nothing.
@dataclass(frozen=True, eq=False)
class Tokenizer:
    """Immutable view of one model's tokenizer; build it with `Tokenizer.from_dir`."""

    backend: tokenizers.Tokenizer
    bos_token: str | None
    eos_token: str | None
    bos_token_id: int | None
    eos_token_ids: frozenset[int]
    add_bos_token: bool
    chat_template: str | None
    special_tokens: Mapping[str, str | None]

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        folder = Path(path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerLoadError(
                f"no tokenizer.json in {folder} (only fast tokenizers are supported; "
                "--tokenizer names another folder's)"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as error:  # the Rust side raises bare Exception subclasses
            raise TokenizerLoadError(f"cannot load {tokenizer_file}: {error}") from error

        config = _read_json(folder / "tokenizer_config.json")
        generation = _read_json(folder / "generation_config.json")
        model_config = _read_json(folder / "config.json")

        special = {
            name: _token_content(config.get(name))
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
        }
        bos_token, eos_token = special["bos_token"], special["eos_token"]

        bos_id = backend.token_to_id(bos_token) if bos_token is not None else None
        if bos_id is None:
            candidates = _as_id_list(model_config.get("bos_token_id"))
            bos_id = candidates[0] if candidates else None

        # Any of these may name the end of a turn: stop on their union.
        eos_ids: set[int] = set()
        if eos_token is not None and (eos_id := backend.token_to_id(eos_token)) is not None:
            eos_ids.add(eos_id)
        eos_ids.update(_as_id_list(generation.get("eos_token_id")))
        eos_ids.update(_as_id_list(model_config.get("eos_token_id")))

        template = chat_template_of(folder, config)

        return cls(
            backend=backend,
            bos_token=bos_token,
            eos_token=eos_token,
            bos_token_id=bos_id,
            eos_token_ids=frozenset(eos_ids),
            add_bos_token=bool(config.get("add_bos_token", False)),
            chat_template=template,
            special_tokens=special,
        )

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    @cached_property
    def byte_fallback_ids(self) -> frozenset[int]:
        """Ids of `<0xNN>` pieces: ByteFallback decodes a run of them only as a whole, so
        streaming must not emit text while such a run may still grow."""
        vocab = self.backend.get_vocab(with_added_tokens=False)
        return frozenset(i for token, i in vocab.items() if _BYTE_TOKEN.fullmatch(token))

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        """Ids that `decode(..., skip_special_tokens=True)` drops."""
        added = self.backend.get_added_tokens_decoder()
        return frozenset(int(i) for i, token in added.items() if token.special)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > LONG_TEXT_CHARS:
            # encode_batch releases the GIL (encode does not); same ids.
            (encoding,) = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)
            return list(encoding.ids)
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        # No clean_up_tokenization_spaces: the incremental detokenizer must agree (as vLLM).
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_to_id(self, token: str) -> int | None:
        result = self.backend.token_to_id(token)
        return None if result is None else int(result)

    def id_to_token(self, token_id: int) -> str | None:
        result = self.backend.id_to_token(token_id)
        return None if result is None else str(result)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        template_limits: TemplateLimits | None = None,
        **extra: Any,
    ) -> str:
        """Renders a conversation to prompt text (to tokenize with `add_special_tokens=False`);
        `chat_template`, if given, replaces the tokenizer's own."""
        template = chat_template if chat_template is not None else self.chat_template
        if template is None:
            raise ChatTemplateError(
                "this tokenizer has no chat template (no chat_template in tokenizer_config.json "
                "and no chat_template.jinja); give one with --chat-template or the request's "
                "chat_template, or send a plain completion prompt instead"
            )
        return render_chat_template(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            special_tokens=self.special_tokens,
            extra=extra,
            limits=template_limits,
        )
