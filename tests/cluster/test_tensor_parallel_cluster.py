"""Pools of different tensor-parallel sizes: the prefill worker runs on 2 ranks
(`--prefill-args '--tensor-parallel-size 2'`), the decode worker on 1. The prefill worker
gathers every kv head from its ranks before sending, so the decode worker receives the same
blocks a TP=1 prefill would send, and the output is the offline engine's to the token."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from nori.engine.llm import LLM
from nori.launch.local_cluster import LocalCluster
from nori.sampling.params import SamplingParams
from tests.cluster.conftest import running_cluster
from tests.cluster.test_cluster_e2e import idle_free_blocks, model_name

pytestmark = pytest.mark.slow

PROMPTS = ["Once upon a time there was a cat", "The weather today is", "A B C D E F G H I J K"]


@pytest.fixture(scope="module")
def tp_cluster(
    redis_url: str, checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    yield from running_cluster(
        redis_url,
        checkpoint,
        tmp_path_factory,
        num_prefill=1,
        num_decode=1,
        prefill_args=("--tensor-parallel-size", "2"),
    )


def test_prefill_on_two_ranks_and_decode_on_one_match_the_offline_engine(
    tp_cluster: LocalCluster, checkpoint: Path
) -> None:
    offline = LLM(str(checkpoint), dtype="float32", num_kv_blocks=256)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = [o.outputs[0].text for o in offline.generate(PROMPTS, greedy, use_tqdm=False)]
    client = openai.OpenAI(base_url=f"{tp_cluster.url}/v1", api_key="unused")
    baseline = idle_free_blocks(tp_cluster)

    def complete(prompt: str) -> str:
        response = client.completions.create(
            model=model_name(tp_cluster),
            prompt=prompt,
            max_tokens=24,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        return response.choices[0].text

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        served = list(pool.map(complete, PROMPTS))
    assert served == expected
    log = tp_cluster.worker("prefill-0").log_path.read_text()
    assert "rank 0 of 2" in log and "tensor parallel: 2 ranks (gloo)" in log
    assert "rank 0 of 2" not in tp_cluster.worker("decode-0").log_path.read_text()
    assert idle_free_blocks(tp_cluster) == baseline
