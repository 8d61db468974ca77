"""Loglikelihood scoring through the disaggregated cluster, proved with the real lm-eval harness.

A cluster (1 prefill, 1 decode worker) serves the TinyStories checkpoint beside this repository
(../shared/models/stories260K; the tests skip without it). `echo` with `logprobs` returns the
prompt tokens' logprobs, computed by the prefill worker, equal to transformers' within 1e-4; then
lm-eval (`local-completions` against the gateway, `hf` on the same checkpoint) runs the two tasks
in tests/data/lm_eval, one multiple-choice (loglikelihood) and one generate-until: the scores
are equal, the generations identical, each loglikelihood within 1e-4. Select with -m lm_eval.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from nori.launch.local_cluster import LocalCluster
from nori.sampling.tokenizer import Tokenizer
from tests.cluster.conftest import start_cluster
from tests.cluster.test_cluster_e2e import idle_free_blocks

REPO = Path(__file__).resolve().parents[2]
STORIES = REPO.parent / "shared" / "models" / "stories260K"
TASKS = ("nori_tiny_mc", "nori_tiny_gen")
ATOL = 1e-4
PROMPT = "Once upon a time, there was a little girl named Lily. She"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.lm_eval,
    pytest.mark.skipif(not (STORIES / "config.json").exists(), reason=f"no model at {STORIES}"),
]


@pytest.fixture(scope="module")
def stories_cluster(
    redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    running = start_cluster(
        redis_url, STORIES, tmp_path_factory.mktemp("lm-eval-logs"), num_decode=1
    )
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def colocated_cluster(
    redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    logs = tmp_path_factory.mktemp("colocated-logs")
    running = start_cluster(redis_url, STORIES, logs, colocated=True)
    try:
        yield running
    finally:
        running.stop()


def hf_log_softmax(token_ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32)
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([token_ids])).logits[0].float(), dim=-1)


@pytest.mark.parametrize("layout", ["stories_cluster", "colocated_cluster"])
def test_echo_scores_the_prompt_as_transformers_does(
    layout: str, request: pytest.FixtureRequest
) -> None:
    """Disaggregated, the prefill worker scores the prompt; colocated, the one worker does."""
    cluster: LocalCluster = request.getfixturevalue(layout)
    api = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0)
    before = idle_free_blocks(cluster)
    scored = api.completions.create(
        model="stories260K", prompt=PROMPT, echo=True, max_tokens=0, logprobs=2, temperature=0
    )
    (choice,) = scored.choices
    assert choice.text == PROMPT
    ids = Tokenizer.from_dir(STORIES).encode(PROMPT)
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    assert len(logprobs.token_logprobs) == len(ids) and logprobs.token_logprobs[0] is None
    expected = hf_log_softmax(ids)
    for i in range(1, len(ids)):
        assert logprobs.token_logprobs[i] == pytest.approx(expected[i - 1, ids[i]].item(), abs=ATOL)
    # With a completion: the same prompt part, then the generated tokens.
    both = api.completions.create(
        model="stories260K", prompt=PROMPT, echo=True, max_tokens=4, logprobs=2, temperature=0
    ).choices[0]
    assert both.text.startswith(PROMPT) and len(both.text) > len(PROMPT)
    assert both.logprobs is not None and both.logprobs.token_logprobs is not None
    assert both.logprobs.token_logprobs[: len(ids)] == logprobs.token_logprobs
    assert len(both.logprobs.token_logprobs) == len(ids) + 4
    api.close()
    # Every block is back (disaggregated, a prompt-only request's decode reservation too).
    assert idle_free_blocks(cluster) == before


def run_lm_eval(model: str, model_args: str, batch_size: int, output: Path) -> dict[str, Any]:
    """`lm_eval` as a user runs it (from the repository root); its results and samples."""
    env = {
        **os.environ,
        # Nothing may be downloaded: the model, tokenizer and data sets are local files.
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(output / "hf-home"),
    }
    command = [
        sys.executable, "-m", "lm_eval",
        "--model", model, "--model_args", model_args, "--batch_size", str(batch_size),
        "--tasks", ",".join(TASKS), "--include_path", "tests/data/lm_eval",
        "--log_samples", "--output_path", str(output), "--device", "cpu",
    ]  # fmt: skip
    finished = subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert finished.returncode == 0, finished.stderr[-4000:]
    (results_file,) = output.rglob("results_*.json")
    samples = {
        task: sorted(
            (json.loads(line) for line in next(output.rglob(f"samples_{task}_*.jsonl")).open()),
            key=lambda sample: sample["doc_id"],
        )
        for task in TASKS
    }
    return {"results": json.loads(results_file.read_text())["results"], "samples": samples}


def test_lm_eval_scores_equal_its_hf_model(stories_cluster: LocalCluster, tmp_path: Path) -> None:
    # BOS as the checkpoint's tokenizer adds it (lm-eval's hf model does; its API models not).
    served = run_lm_eval(
        "local-completions",
        f"model=stories260K,base_url={stories_cluster.url}/v1/completions,tokenizer={STORIES},"
        "tokenizer_backend=huggingface,tokenized_requests=True,add_bos_token=True",
        4,
        tmp_path / "nori",
    )
    reference = run_lm_eval(
        "hf", f"pretrained={STORIES},dtype=float32,add_bos_token=True", 1, tmp_path / "hf"
    )

    mc_served, mc_reference = (
        served["samples"]["nori_tiny_mc"],
        reference["samples"]["nori_tiny_mc"],
    )
    assert len(mc_served) == len(mc_reference) == 6
    for ours, theirs in zip(mc_served, mc_reference, strict=True):
        assert ours["doc_id"] == theirs["doc_id"]
        for (ours_ll, ours_greedy), (theirs_ll, theirs_greedy) in zip(
            ours["filtered_resps"], theirs["filtered_resps"], strict=True
        ):
            assert float(ours_ll) == pytest.approx(float(theirs_ll), abs=ATOL)
            assert ours_greedy == theirs_greedy
        assert (ours["acc"], ours["acc_norm"]) == (theirs["acc"], theirs["acc_norm"])

    gen_served = served["samples"]["nori_tiny_gen"]
    gen_reference = reference["samples"]["nori_tiny_gen"]
    assert len(gen_served) == len(gen_reference) == 5
    for ours, theirs in zip(gen_served, gen_reference, strict=True):
        assert ours["filtered_resps"] == theirs["filtered_resps"]
        assert ours["exact_match"] == theirs["exact_match"]
        # The raw text differs only in the leading space the hf model's decode drops.
        assert ours["resps"][0][0].lstrip() == theirs["resps"][0][0]

    for task in TASKS:  # the scores (and their standard errors), exactly
        assert served["results"][task] == reference["results"][task]
