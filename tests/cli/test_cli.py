"""The `nori` command as a user runs it: a real subprocess, real files, JSON on stdout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nori.engine.llm import LLM
from nori.sampling.params import SamplingParams


def nori(*args: str, cache: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = None
    if cache is not None:
        import os

        env = {**os.environ, "NORI_CACHE_DIR": str(cache)}
    return subprocess.run(
        [sys.executable, "-m", "nori.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("cli") / "tiny"
    result = nori("model", "init", str(folder), "--preset", "tiny", "--seed", "5")
    assert result.returncode == 0, result.stderr
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in folder.iterdir()
    }
    return folder


def test_generate_json_matches_the_python_api(tiny_model: Path) -> None:
    result = nori(
        "generate",
        "--model",
        str(tiny_model),
        "--prompt",
        "the cat",
        "--prompt",
        "once upon a time there was",
        "--max-tokens",
        "7",
        "--temperature",
        "0",
        "--ignore-eos",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["prompt"] for r in records] == ["the cat", "once upon a time there was"]
    expected = LLM(str(tiny_model), num_kv_blocks=64).generate(
        ["the cat", "once upon a time there was"],
        SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
    )
    for record, output in zip(records, expected, strict=True):
        (completion,) = output.outputs
        assert record["token_ids"] == completion.token_ids and len(record["token_ids"]) == 7
        assert record["text"] == completion.text and record["index"] == 0
        assert record["prompt_token_ids"] == output.prompt_token_ids
        assert record["finish_reason"] == "length"


def test_stop_token_id_flag(tiny_model: Path) -> None:
    first = nori(
        "generate", "--model", str(tiny_model), "--prompt", "a b", "--max-tokens", "6",
        "--temperature", "0", "--ignore-eos", "--json",
    )  # fmt: skip
    tokens = json.loads(first.stdout)["token_ids"]
    stopped = nori(
        "generate", "--model", str(tiny_model), "--prompt", "a b", "--max-tokens", "6",
        "--temperature", "0", "--ignore-eos", "--json", "--stop-token-id", str(tokens[2]),
    )  # fmt: skip
    record = json.loads(stopped.stdout)
    assert record["token_ids"] == tokens[: tokens.index(tokens[2]) + 1]
    assert record["finish_reason"] == "stop" and record["stop_reason"] == tokens[2]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "/no/such/folder"], "no/such/folder"),
        (["--temperature", "-1"], "temperature"),
        (["--max-tokens", "0"], "max_tokens"),
    ],
)
def test_bad_input_is_one_clear_line(tiny_model: Path, args: list[str], message: str) -> None:
    base = ["generate", "--model", str(tiny_model), "--prompt", "hi"]
    result = nori(*base, *args)
    assert result.returncode == 2
    assert result.stderr.startswith("nori: error:") and message in result.stderr
    assert "Traceback" not in result.stderr


def test_unknown_preset_is_rejected(tmp_path: Path) -> None:
    result = nori("model", "init", str(tmp_path / "x"), "--preset", "no-such-preset")
    assert result.returncode == 2 and "no-such-preset" in result.stderr


def test_bench_offline_json(tiny_model: Path) -> None:
    result = nori(
        "bench", "offline", "--model", str(tiny_model), "--num-prompts", "6",
        "--input-len-range", "4:20", "--output-len-range", "2:12", "--compare-static", "--json",
        "--max-num-seqs", "2", "--repeats", "3",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["num_prompts"] == 6 and report["repeats"] == 3
    # The reported run of each policy is its median one.
    for policy in ("continuous", "static"):
        runs = report[f"{policy}_seconds_all"]
        assert len(runs) == 3 and report[f"{policy}_seconds"] == sorted(runs)[1]
    assert report["continuous_output_tok_s"] > 0 and report["static_output_tok_s"] > 0
    ratio = report["continuous_output_tok_s"] / report["static_output_tok_s"]
    assert report["ratio"] == pytest.approx(ratio, rel=0.01)
    # Static batches of 2 wait for their longest member: more steps for the same tokens.
    assert report["static_steps"] > report["continuous_steps"]


def test_bench_rejects_a_bad_range(tiny_model: Path) -> None:
    result = nori("bench", "offline", "--model", str(tiny_model), "--input-len-range", "9:3")
    assert result.returncode == 2 and "9:3" in result.stderr
    result = nori("bench", "offline", "--model", str(tiny_model), "--repeats", "0")
    assert result.returncode == 2 and "repeats" in result.stderr


def test_bench_offline_refuses_requests_the_model_would_cut_short(tiny_model: Path) -> None:
    """500-token prompts with 100 output tokens on a 512-position model: refused, not measured
    on the 12 tokens the engine could produce."""
    result = nori(
        "bench", "offline", "--model", str(tiny_model), "--num-prompts", "3",
        "--input-len-range", "500:500", "--output-len-range", "100:100", "--max-model-len", "512",
    )  # fmt: skip
    assert result.returncode == 2, result.stdout
    assert "3 of 3 requests need more than max_model_len=512" in result.stderr
    assert "Traceback" not in result.stderr and "tok_s" not in result.stdout


def test_demo_model_is_created_on_first_use(tmp_path: Path) -> None:
    result = nori(
        "generate",
        "--model",
        "demo",
        "--prompt",
        "hello",
        "--max-tokens",
        "3",
        "--json",
        cache=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert len(json.loads(result.stdout)["token_ids"]) <= 3
    assert any(tmp_path.rglob("config.json"))


def test_model_init_keeps_an_existing_checkpoint_unless_forced(tiny_model: Path) -> None:
    before = (tiny_model / "model.safetensors").read_bytes()
    result = nori("model", "init", str(tiny_model), "--preset", "tiny", "--seed", "6")
    assert result.returncode == 2
    assert (
        result.stderr
        == f"nori: error: {tiny_model} already holds a checkpoint; pass --force to replace it\n"
    )
    assert (tiny_model / "model.safetensors").read_bytes() == before


def test_a_max_model_len_past_the_models_positions_is_refused(tiny_model: Path) -> None:
    result = nori(
        "generate", "--model", str(tiny_model), "--prompt", "hi", "--max-model-len", "100000"
    )
    assert result.returncode == 2, result.stderr
    assert "max_model_len 100000 exceeds the model's max_position_embeddings (1024)" in (
        result.stderr
    )
    assert "Traceback" not in result.stderr


def test_a_folder_without_weights_says_how_to_load_it(tmp_path: Path) -> None:
    folder = tmp_path / "shape-only"
    assert nori("model", "init", str(folder), "--preset", "tiny", "--no-weights").returncode == 0
    result = nori("generate", "--model", str(folder), "--prompt", "hi", "--max-tokens", "2")
    assert result.returncode == 2, result.stderr
    assert "--load-format dummy" in result.stderr and "Traceback" not in result.stderr
    dummy = nori(
        "generate", "--model", str(folder), "--prompt", "hi", "--max-tokens", "2",
        "--load-format", "dummy",
    )  # fmt: skip
    assert dummy.returncode == 0, dummy.stderr
