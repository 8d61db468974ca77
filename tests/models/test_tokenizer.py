from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from nori.models.init_checkpoint import init_checkpoint
from nori.models.tokenizer_builder import BOS_ID, EOS_IDS, SPECIAL_TOKENS

TEXTS = (
    "Once upon a time, a little dragon found a book.",
    "Ünïcödé, emoji 🙂, tabs\tand\nnewlines, numbers 12345 and symbols <|not special|>.",
    "",
)


@pytest.fixture(scope="module")
def demo_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_checkpoint(tmp_path_factory.mktemp("demo"), "demo", write_weights=False)


def test_size_specials_and_every_id_decodes(demo_folder: Path) -> None:
    tokenizer = Tokenizer.from_file(str(demo_folder / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == 2048
    for index, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == index
    for token_id in range(2048):
        assert tokenizer.id_to_token(token_id) is not None
        tokenizer.decode([token_id], skip_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(demo_folder: Path, text: str) -> None:
    tokenizer = Tokenizer.from_file(str(demo_folder / "tokenizer.json"))
    ids = tokenizer.encode(text).ids
    assert ids[0] == BOS_ID
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    hf = AutoTokenizer.from_pretrained(demo_folder)
    assert hf(text).input_ids == ids  # exactly one BOS, same merges
    assert hf.decode(ids, skip_special_tokens=True) == text


def test_trained_merges_compress_english(demo_folder: Path) -> None:
    tokenizer = Tokenizer.from_file(str(demo_folder / "tokenizer.json"))
    text = "The teacher walked to the market with her friend."
    assert len(tokenizer.encode(text, add_special_tokens=False).ids) < len(text) / 3


def test_chat_template_renders_with_transformers(demo_folder: Path) -> None:
    hf = AutoTokenizer.from_pretrained(demo_folder)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|begin_of_text|><|system|>\nBe brief.<|end|>\n<|user|>\nHi there<|end|>\n"
        "<|assistant|>\nHello.<|end|>\n<|user|>\nBye<|end|>\n<|assistant|>\n"
    )
    no_prompt = hf.apply_chat_template(messages[:2], tokenize=False)
    assert not no_prompt.endswith("<|assistant|>\n")
    ids = hf(text, add_special_tokens=False).input_ids
    assert ids[0] == BOS_ID and ids.count(SPECIAL_TOKENS.index("<|end|>")) == 4
    assert hf.eos_token_id in EOS_IDS


def test_large_vocab_is_padded_with_reserved_tokens(tmp_path: Path) -> None:
    folder = init_checkpoint(tmp_path / "big", "llama3-1b", write_weights=False)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == 128256
    assert tokenizer.decode([128255]).startswith("<|reserved_")
    # Padding is plain vocabulary no merge reaches, so text never encodes to it.
    first_reserved = tokenizer.token_to_id("<|reserved_0|>")
    assert max(tokenizer.encode(TEXTS[1]).ids) < first_reserved
    hf = AutoTokenizer.from_pretrained(folder)
    assert len(hf) == 128256 and hf.decode([first_reserved]) == "<|reserved_0|>"
