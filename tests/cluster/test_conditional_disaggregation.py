"""Conditional disaggregation through real processes (--disaggregation auto): a gateway, one
prefill and one decode worker, UCX, Redis, the openai client.

The first prompts go to the prefill worker (nothing is measured yet); once the workers have
published their step-cost fits and the gateway has measured the prefill path, short prompts on
an idle cluster cost less on the decode worker, which computes them itself. Whichever path a
request takes, greedy outputs are token-identical to the offline engine, the decision is
counted on the gateway's /metrics, and every KV block comes back.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from nori.engine.llm import LLM
from nori.launch.local_cluster import LocalCluster
from nori.sampling.params import SamplingParams
from tests.cluster.conftest import running_cluster
from tests.cluster.test_cluster_e2e import (
    client,
    greedy_completion,
    idle_free_blocks,
    model_name,
    stats,
)

pytestmark = pytest.mark.slow

PROMPTS = [
    "Once upon a time",
    "The little dog ran to the",
    "In a small village there lived an old man who",
    "1 2 3 4 5 6 7 8 9 10",
    "She looked at the sky and said",
    "a b c d e f g h",
]
_DECISION = re.compile(
    r'^nori_gateway_disaggregation_decisions_total\{path="(\w+)",reason="(\w+)"\} ([0-9.]+)$',
    re.MULTILINE,
)


@pytest.fixture(scope="module")
def auto_cluster(
    redis_url: str, checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    yield from running_cluster(
        redis_url, checkpoint, tmp_path_factory, num_decode=1, disaggregation="auto"
    )


def decisions(cluster: LocalCluster) -> dict[tuple[str, str], int]:
    text = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    return {(path, reason): int(float(n)) for path, reason, n in _DECISION.findall(text)}


def test_short_prompts_move_to_the_decode_worker_and_stay_token_exact(
    auto_cluster: LocalCluster, checkpoint: Path
) -> None:
    offline = LLM(str(checkpoint), dtype="float32", num_kv_blocks=512)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = [output.outputs[0].text for output in offline.generate(PROMPTS, params)]
    baseline = idle_free_blocks(auto_cluster)
    openai_client, model = client(auto_cluster), model_name(auto_cluster)

    def complete(prompt: str) -> str:
        return greedy_completion(openai_client, model, prompt, 8).choices[0].text

    # Nothing is measured before the first request: it goes to the prefill worker, as every
    # prompt always did. A few more of varied lengths give the workers' fits their steps.
    warm_up = ["a " * length for length in (3, 40, 9, 70, 20)]
    complete(warm_up[0])
    assert decisions(auto_cluster) == {("prefill", "not_measured"): 1}
    for prompt in warm_up[1:]:
        complete(prompt)
    # The fits reach the gateway with the workers' heartbeats.
    time.sleep(2.5)
    before = decisions(auto_cluster)
    computed_before = stats(auto_cluster, "decode-0").num_prompt_tokens_computed
    texts = [complete(prompt) for prompt in PROMPTS]
    assert texts == expected

    after = decisions(auto_cluster)
    made = {key: after[key] - before.get(key, 0) for key in after}
    assert sum(made.values()) == len(PROMPTS)
    # On an idle cluster a short prompt costs less where it is decoded than a hop away.
    assert made.get(("decode", "cheaper_on_decode"), 0) >= 1, made
    # The decode worker computed those prompts itself.
    computed = stats(auto_cluster, "decode-0").num_prompt_tokens_computed - computed_before
    assert computed > 0
    assert idle_free_blocks(auto_cluster) == baseline
