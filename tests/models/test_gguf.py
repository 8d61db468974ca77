"""GGUF checkpoints: `--model FILE.gguf` and the packaged SmolLM2-135M-Instruct, against transformers.

The reference is transformers reading the same GGUF file itself (its GGUF loader dequantizes the
weights, its own Llama code runs them); Nori reads the model folder converted from that file and
runs its own engine (paged attention, continuous batching). Greedy, float32: token-exact.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nori.models.demo import default_model, resolve_model
from nori.models.errors import ModelLoadError
from nori.models.gguf_checkpoint import (
    SMOLLM2_INSTALL,
    converted_folder,
    ensure_gguf_checkpoint,
    is_gguf_path,
    packaged_gguf,
)

SMOLLM2 = "smollm2-135m-instruct"
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a CPU cache is in one sentence.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Give me a name for a black cat.",
    "Why is the sky blue?",
]
NUM_TOKENS = 64


def test_gguf_paths_are_told_from_folders_and_names() -> None:
    assert is_gguf_path("/models/SmolLM2.Q4_1.gguf") and is_gguf_path("x.GGUF")
    assert not is_gguf_path("demo") and not is_gguf_path("/models/llama")


def test_a_missing_gguf_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model(str(tmp_path / "absent.gguf"), cache_dir=tmp_path / "cache")


def test_a_file_that_is_not_gguf_is_a_clear_error(tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="cannot read GGUF file"):
        ensure_gguf_checkpoint(broken, tmp_path / "cache")
    assert not list((tmp_path / "cache").iterdir())  # no half-written folder left behind


def test_a_packaged_model_without_its_package_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def not_installed(distribution: str) -> None:
        raise importlib.metadata.PackageNotFoundError(distribution)

    monkeypatch.setattr(importlib.metadata, "files", not_installed)
    with pytest.raises(ModelLoadError, match=re.escape(SMOLLM2_INSTALL)):
        packaged_gguf(SMOLLM2)


def _smollm2_gguf() -> Path:
    try:
        return packaged_gguf(SMOLLM2)
    except ModelLoadError as error:
        pytest.skip(str(error))


@pytest.fixture(scope="module")
def smollm2_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The packaged GGUF converted once, into a cache of this module's own."""
    _smollm2_gguf()
    cache = tmp_path_factory.mktemp("gguf-cache")
    return resolve_model(SMOLLM2, cache_dir=cache)


def test_a_conversion_is_keyed_by_the_files_identity(tmp_path: Path) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF" + bytes(60))
    cache = tmp_path / "cache"
    first = converted_folder(model, cache)
    assert first == converted_folder(model, cache) and first.parent == cache
    assert first.name.startswith("gguf-model-")
    copy = tmp_path / "elsewhere" / "model.gguf"
    copy.parent.mkdir()
    shutil.copyfile(model, copy)
    assert converted_folder(copy, cache) != first  # another file
    os.utime(model, ns=(1, 1))
    assert converted_folder(model, cache) != first  # this one rewritten


def test_a_converted_checkpoint_is_found_again_without_converting(smollm2_folder: Path) -> None:
    assert (smollm2_folder / "config.json").is_file()
    assert list(smollm2_folder.glob("*.safetensors"))
    assert (smollm2_folder / "tokenizer.json").is_file()
    assert resolve_model(SMOLLM2, cache_dir=smollm2_folder.parent) == smollm2_folder
    assert [p.name for p in smollm2_folder.parent.iterdir()] == [smollm2_folder.name]


def _reference_greedy(gguf: Path, prompts: list[list[int]]) -> list[list[int]]:
    """transformers on the GGUF file itself: greedy, one prompt at a time, KV cache on."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    completions = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            output = model(ids, use_cache=True)
            generated: list[int] = []
            for _ in range(NUM_TOKENS):
                token = int(output.logits[0, -1].argmax())
                generated.append(token)
                output = model(
                    torch.tensor([[token]]), past_key_values=output.past_key_values, use_cache=True
                )
            completions.append(generated)
    return completions


@pytest.mark.slow
def test_smollm2_gguf_is_token_exact_against_transformers(smollm2_folder: Path) -> None:
    from transformers import AutoTokenizer

    from nori.engine.llm import LLM
    from nori.sampling.params import SamplingParams

    gguf = _smollm2_gguf()
    # The prompts as transformers' own tokenizer of the GGUF renders them (its chat template).
    reference_tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    prompts = [
        list(
            reference_tokenizer.apply_chat_template(
                [{"role": "user", "content": question}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )
        for question in QUESTIONS
    ]
    expected = _reference_greedy(gguf, prompts)

    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(str(smollm2_folder), dtype="float32", num_kv_blocks=128, max_num_seqs=8) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        got = [list(output.outputs[0].token_ids) for output in outputs]
        for question, want, have in zip(QUESTIONS, expected, got, strict=True):
            assert have == want, (question, want, have)
        # Its own tokenizer and chat template, from the GGUF: the answer a user would see.
        answer = llm.chat(
            [{"role": "user", "content": QUESTIONS[0]}],
            SamplingParams(max_tokens=32, temperature=0.0),
            use_tqdm=False,
        )[0]
    assert answer.prompt == reference_tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTIONS[0]}], add_generation_prompt=True, tokenize=False
    )
    assert answer.outputs[0].text.strip() == "The capital of France is Paris."


def test_without_its_package_the_default_model_is_demo_said_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def not_installed(distribution: str) -> None:
        raise importlib.metadata.PackageNotFoundError(distribution)

    monkeypatch.setattr(importlib.metadata, "files", not_installed)
    assert default_model() == "demo"
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and SMOLLM2_INSTALL in lines[0] and "'demo'" in lines[0]


def test_the_commands_default_model_answers_a_first_question(smollm2_folder: Path) -> None:
    """`nori generate` with no --model: SmolLM2-135M-Instruct, in the dtype `auto` picks here."""
    assert default_model() == SMOLLM2
    result = subprocess.run(
        [
            *(sys.executable, "-m", "nori.cli.main", "generate", "--chat", "--temperature", "0"),
            *("--prompt", QUESTIONS[0], "--max-tokens", "16", "--num-kv-blocks", "64"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NORI_CACHE_DIR": str(smollm2_folder.parent)},
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
