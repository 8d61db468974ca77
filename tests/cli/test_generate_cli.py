"""`nori generate -n` and the progress bars of `generate` and `bench offline`, as a user runs them:
a subprocess, with stderr a pipe or a real terminal (a pty)."""

from __future__ import annotations

import fcntl
import json
import os
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

import pytest

from nori.engine.llm import LLM
from nori.models.init_checkpoint import init_checkpoint
from nori.sampling.params import SamplingParams

BAR = "Processed prompts"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("cli") / "tiny"
    init_checkpoint(folder, "tiny", seed=8)
    return folder


def nori_on_a_terminal(*args: str) -> tuple[int, str, str]:
    """Runs `nori ARGS` with stderr a terminal: exit status, stdout, what the terminal showed."""
    master, slave = os.openpty()
    # A terminal 160 columns wide (a new pty has none, and a bar sized to it would be empty).
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    process = subprocess.Popen(
        [sys.executable, "-m", "nori.cli.main", *args],
        stdout=subprocess.PIPE,
        stderr=slave,
        text=True,
    )
    os.close(slave)
    shown: list[bytes] = []

    def read_terminal() -> None:
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the child closed its end
                return
            if not chunk:
                return
            shown.append(chunk)

    reader = threading.Thread(target=read_terminal)
    reader.start()
    try:
        stdout, _ = process.communicate(timeout=300)
    finally:
        reader.join(timeout=10)
        os.close(master)
    return process.returncode, stdout, b"".join(shown).decode(errors="replace")


def test_generate_n_prints_each_seeded_completion(tiny_model: Path) -> None:
    prompts = ["the cat", "once upon a time"]
    result = subprocess.run(
        [
            sys.executable, "-m", "nori.cli.main", "generate", "--model", str(tiny_model),
            "--prompt", prompts[0], "--prompt", prompts[1], "-n", "3", "--sampling-seed", "5",
            "--max-tokens", "6", "--ignore-eos", "--num-kv-blocks", "64", "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(r["prompt"], r["index"]) for r in records] == [
        (p, i) for p in prompts for i in range(3)
    ]
    # stderr is not a terminal here: no bar mixed into what a script captures.
    assert BAR not in result.stderr
    expected = LLM(str(tiny_model), num_kv_blocks=64).generate(
        prompts, SamplingParams(n=3, seed=5, max_tokens=6, ignore_eos=True), use_tqdm=False
    )
    completions = [c for output in expected for c in output.outputs]
    assert [r["token_ids"] for r in records] == [c.token_ids for c in completions]
    assert [r["text"] for r in records] == [c.text for c in completions]
    assert len({tuple(r["token_ids"]) for r in records[:3]}) == 3  # seeds 5, 6, 7 differ


@pytest.mark.parametrize("off", ["--no-progress", "--disable-progress-bar"])
def test_generate_draws_a_bar_on_a_terminal_only_to_stderr(tiny_model: Path, off: str) -> None:
    base = (
        "generate", "--model", str(tiny_model), "--prompt", "a b", "--prompt", "c d",
        "--max-tokens", "4", "--num-kv-blocks", "64", "--json",
    )  # fmt: skip
    status, stdout, terminal = nori_on_a_terminal(*base)
    assert status == 0, terminal
    assert f"{BAR}: 100%" in terminal and "2/2" in terminal and "toks/s" in terminal
    # stdout holds the records alone.
    assert [json.loads(line)["prompt"] for line in stdout.splitlines()] == ["a b", "c d"]
    status, stdout, terminal = nori_on_a_terminal(*base, off)
    assert status == 0, terminal
    assert BAR not in terminal and len(stdout.splitlines()) == 2


def test_bench_offline_draws_a_bar_on_a_terminal(tiny_model: Path) -> None:
    base = (
        "bench", "offline", "--model", str(tiny_model), "--num-prompts", "3",
        "--input-len-range", "4:8", "--output-len-range", "2:4", "--json",
    )  # fmt: skip
    status, stdout, terminal = nori_on_a_terminal(*base)
    assert status == 0, terminal
    assert "continuous" in terminal and "3/3 requests" in terminal and "tok/s" in terminal
    assert json.loads(stdout)["num_prompts"] == 3
    status, stdout, terminal = nori_on_a_terminal(*base, "--disable-progress-bar")
    assert status == 0, terminal
    assert "requests" not in terminal and json.loads(stdout)["num_prompts"] == 3
