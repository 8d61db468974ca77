"""8-bit weights across the cluster: `--quantization int8` given to every worker, one request
at a time, disaggregated: the prefill worker's KV and the decode worker's steps give exactly
what the offline engine with the same flag gives.

One request at a time because the CPU int8 GEMM quantizes its activations with one scale per
call: rows batched together share it, so batch mates can move each other's last bits (as with
vLLM's dynamic per-tensor activation scales). Alone, the prompt and each decode step see the same
batch in both places.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from nori.engine.llm import LLM
from nori.launch.local_cluster import LocalCluster
from nori.sampling.params import SamplingParams
from tests.cluster.conftest import WORKER_ARGS, running_cluster
from tests.cluster.test_cluster_e2e import idle_free_blocks, model_name

pytestmark = pytest.mark.slow

PROMPTS = ["Once upon a time there was a cat", "The weather today is"]


@pytest.fixture(scope="module")
def int8_cluster(
    redis_url: str, checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    yield from running_cluster(
        redis_url,
        checkpoint,
        tmp_path_factory,
        num_prefill=1,
        num_decode=1,
        worker_args=(*WORKER_ARGS, "--quantization", "int8"),
    )


def test_a_disaggregated_int8_cluster_matches_the_offline_int8_engine(
    int8_cluster: LocalCluster, checkpoint: Path
) -> None:
    offline = LLM(str(checkpoint), dtype="float32", num_kv_blocks=256, quantization="int8")
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    client = openai.OpenAI(base_url=f"{int8_cluster.url}/v1", api_key="unused")
    baseline = idle_free_blocks(int8_cluster)
    for prompt in PROMPTS:
        (expected,) = offline.generate([prompt], greedy, use_tqdm=False)
        served = client.completions.create(
            model=model_name(int8_cluster),
            prompt=prompt,
            max_tokens=20,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        assert served.choices[0].text == expected.outputs[0].text
    # The workers really run int8: their logs name the weights.
    for role in ("prefill-0", "decode-0"):
        assert "int8 weights" in int8_cluster.worker(role).log_path.read_text()
    assert idle_free_blocks(int8_cluster) == baseline
