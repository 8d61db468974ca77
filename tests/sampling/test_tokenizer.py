from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest

from nori.sampling.chat_template import ChatTemplateError
from nori.sampling.tokenizer import Tokenizer, TokenizerLoadError
from tests.sampling.helpers import CORPUS, build_byte_level_dir, require_stories

TEXTS = [
    *CORPUS,
    "Hello world",
    "",
    " leading space",
    "trailing space ",
    "two  spaces",
    "Lily and Tom went to the park. They saw a big 🐶!",
    "<s> literal special token text </s>",
    "日本語のテキスト",
]


def hf_tokenizer(path: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def byte_level_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_byte_level_dir(tmp_path_factory.mktemp("bytelevel"))


@pytest.mark.parametrize("source", ["stories", "byte_level"])
def test_encode_decode_match_transformers(source: str, byte_level_dir: Path) -> None:
    path = require_stories() if source == "stories" else byte_level_dir
    ours = Tokenizer.from_dir(path)
    theirs = hf_tokenizer(path)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"], text
        assert (
            ours.encode(text, add_special_tokens=False)
            == theirs(text, add_special_tokens=False)["input_ids"]
        )
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                ids, skip_special_tokens=skip
            )
    assert ours.vocab_size == len(theirs)


def test_stories_special_ids() -> None:
    tok = Tokenizer.from_dir(require_stories())
    assert tok.bos_token_id == 1
    assert tok.eos_token_ids == frozenset({2})
    assert tok.encode("Once upon a time")[0] == 1
    assert len(tok.byte_fallback_ids) == 256
    assert tok.special_token_ids == frozenset({0, 1, 2})


def test_eos_ids_are_union_of_all_sources(byte_level_dir: Path) -> None:
    tok = Tokenizer.from_dir(byte_level_dir)
    eos = tok.token_to_id("<|eos|>")
    assert tok.eos_token_ids == frozenset({eos, 1, 7, 9})
    assert tok.bos_token == "<|bos|>"  # given as an AddedToken dict
    assert tok.bos_token_id == tok.token_to_id("<|bos|>")


def test_chat_template_matches_transformers(byte_level_dir: Path) -> None:
    ours = Tokenizer.from_dir(byte_level_dir)
    theirs = hf_tokenizer(byte_level_dir)
    messages = [
        {"role": "system", "content": "  Be brief. "},
        {"role": "user", "content": "Héllo 😀", "meta": {"tag": "ü", "n": [1, 2]}},
        {"role": "assistant", "content": "Hi"},
    ]
    for generation_prompt in (True, False):
        expected = theirs.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )
        assert ours.apply_chat_template(messages, generation_prompt) == expected
    assert '{"tag": "ü", "n": [1, 2]}' in ours.apply_chat_template(messages)


def test_chat_template_raise_exception(byte_level_dir: Path) -> None:
    tok = Tokenizer.from_dir(byte_level_dir)
    with pytest.raises(ChatTemplateError, match="unknown role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_named_chat_templates(tmp_path: Path) -> None:
    named = [
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": "{{ messages[0]['content'] }}!"},
    ]
    tok = Tokenizer.from_dir(build_byte_level_dir(tmp_path, chat_template=named))
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi!"


def test_missing_chat_template_is_clear(tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(build_byte_level_dir(tmp_path, chat_template=None))
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_jinja_file_wins(tmp_path: Path) -> None:
    folder = build_byte_level_dir(tmp_path)
    (folder / "chat_template.jinja").write_text("FILE{{ messages | length }}")
    tok = Tokenizer.from_dir(folder)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "FILE1"


def test_missing_tokenizer_json_names_path(tmp_path: Path) -> None:
    with pytest.raises(TokenizerLoadError, match=str(tmp_path)):
        Tokenizer.from_dir(tmp_path)


def test_bad_config_json_is_load_error(tmp_path: Path) -> None:
    folder = build_byte_level_dir(tmp_path)
    (folder / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerLoadError, match=r"tokenizer_config\.json"):
        Tokenizer.from_dir(folder)


def test_post_processor_decides_bos_like_transformers(tmp_path: Path) -> None:
    # transformers 5 keeps tokenizer.json's post-processor as is: no BOS without one, even
    # with add_bos_token true. Same here.
    source = require_stories()
    folder = tmp_path / "nopp"
    shutil.copytree(source, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    data = json.loads((folder / "tokenizer.json").read_text())
    data["post_processor"] = None
    (folder / "tokenizer.json").write_text(json.dumps(data))
    ours = Tokenizer.from_dir(folder)
    assert ours.add_bos_token
    assert ours.encode("Hello world") == hf_tokenizer(folder)("Hello world")["input_ids"]
    assert ours.encode("Hello world")[0] != 1
