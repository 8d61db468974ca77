"""Pools of different tensor-parallel sizes: the prefill worker on 2 ranks and the decode worker
on 1 (`--prefill-args '--tensor-parallel-size 2'`), then the other way round. A TP=2 prefill
worker gathers every kv head from its ranks before sending, so it sends what a TP=1 one would;
a TP=2 decode worker receives the blocks whole into a staging copy and gives each rank its
heads. Either way the output is the offline engine's to the token."""

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


TWO_RANKS = ("--tensor-parallel-size", "2")


@pytest.fixture(scope="module", params=["prefill", "decode"])
def tp_cluster(
    request: pytest.FixtureRequest,
    redis_url: str,
    checkpoint: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[LocalCluster, str]]:
    """A cluster whose `request.param` pool runs on 2 ranks, and the name of that worker."""
    pool_args = {f"{request.param}_args": TWO_RANKS}
    for cluster in running_cluster(
        redis_url, checkpoint, tmp_path_factory, num_prefill=1, num_decode=1, **pool_args
    ):
        yield cluster, f"{request.param}-0"


def test_pools_of_different_tensor_parallel_sizes_match_the_offline_engine(
    tp_cluster: tuple[LocalCluster, str], checkpoint: Path
) -> None:
    cluster, split_worker = tp_cluster
    offline = LLM(str(checkpoint), dtype="float32", num_kv_blocks=256)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = [o.outputs[0].text for o in offline.generate(PROMPTS, greedy, use_tqdm=False)]
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused")
    baseline = idle_free_blocks(cluster)

    def complete(prompt: str) -> str:
        response = client.completions.create(
            model=model_name(cluster),
            prompt=prompt,
            max_tokens=24,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        return response.choices[0].text

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        served = list(pool.map(complete, PROMPTS))
    assert served == expected
    for name in ("prefill-0", "decode-0"):
        log = cluster.worker(name).log_path.read_text()
        split = "rank 0 of 2" in log and "tensor parallel: 2 ranks (gloo)" in log
        assert split == (name == split_worker), name
    assert idle_free_blocks(cluster) == baseline
