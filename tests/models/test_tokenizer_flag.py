"""`--tokenizer`: a model served with another folder's tokenizer (vLLM's flag), checked against
the same model with its own tokenizer in place."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pytest

from nori.cli.engine_args import add_engine_args, engine_config_from_args
from nori.engine.llm import LLM
from nori.models.init_checkpoint import init_checkpoint
from nori.sampling.params import SamplingParams
from nori.sampling.tokenizer import TokenizerLoadError

PROMPTS = ["the cat sat on the mat", "once upon a time there was"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def test_a_model_folder_without_a_tokenizer_runs_with_another_folders(tmp_path: Path) -> None:
    original = init_checkpoint(tmp_path / "original", "tiny", seed=13)
    bare = tmp_path / "bare"
    shutil.copytree(original, bare)
    removed = [name for name in TOKENIZER_FILES if (bare / name).exists()]
    assert "tokenizer.json" in removed
    for name in removed:
        (bare / name).unlink()
    with pytest.raises(TokenizerLoadError, match="--tokenizer"):
        LLM(str(bare), dtype="float32")

    options = {"dtype": "float32", "block_size": 8, "num_kv_blocks": 64}
    with LLM(str(original), **options) as reference:
        expected = reference.generate(PROMPTS, GREEDY)
    with LLM(str(bare), tokenizer=str(original), **options) as llm:
        got = llm.generate(PROMPTS, GREEDY)
        # The chat template is the tokenizer folder's too.
        assert llm.tokenizer.chat_template == reference.tokenizer.chat_template
    assert [[c.token_ids for c in o.outputs] for o in got] == [
        [c.token_ids for c in o.outputs] for o in expected
    ]
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in expected]
    assert [o.prompt_token_ids for o in got] == [o.prompt_token_ids for o in expected]


def test_the_flag_reaches_the_engine_config() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config_from_args(parser.parse_args(["--model", "m", "--tokenizer", "t.gguf"]))
    assert (config.model, config.tokenizer) == ("m", "t.gguf")
    assert engine_config_from_args(parser.parse_args([])).tokenizer is None
