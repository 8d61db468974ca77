"""Shared fixtures for the sampling tests: the real tiny checkpoint and a tokenizer built here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

REPO_ROOT = Path(__file__).resolve().parents[2]
STORIES_DIR = REPO_ROOT.parent / "shared" / "models" / "stories260K"

CORPUS = [
    "Once upon a time there was a little dog named Max.",
    "Héllo wörld! Ünïcödé text, 中文字符 and emoji 😀🎉 are fine.",
    "def f(x):\n    return x * 2  # code, tabs\tand  spaces",
    "The quick brown fox jumps over the lazy dog. 1234567890 !@#$%^&*()",
]

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['user', 'assistant', 'system'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}\n"
    "  <|{{ message['role'] }}|>{{ message['content'] | trim }}{{ eos_token }}\n"
    "{% if message.get('meta') %}{{ message['meta'] | tojson }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def require_stories() -> Path:
    if not (STORIES_DIR / "tokenizer.json").is_file():
        pytest.skip(f"stories260K checkpoint not found at {STORIES_DIR}")
    return STORIES_DIR


def build_byte_level_dir(folder: Path, chat_template: object = CHAT_TEMPLATE) -> Path:
    """Trains a small GPT-2 style byte-level BPE and writes it as a HF model folder."""
    backend = RustTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|bos|>", "<|eos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(CORPUS * 5, trainer=trainer)
    bos = backend.token_to_id("<|bos|>")
    backend.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", bos)]
    )
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": {"__type": "AddedToken", "content": "<|bos|>", "special": True},
        "eos_token": "<|eos|>",
        "add_bos_token": True,
        "clean_up_tokenization_spaces": False,
        "chat_template": chat_template,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 7]}))
    (folder / "config.json").write_text(json.dumps({"eos_token_id": 9}))
    return folder
