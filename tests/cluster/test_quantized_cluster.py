"""8-bit weights and an 8-bit KV cache across the cluster: `--quantization int8` (and then
`--kv-cache-dtype fp8` too) given to every worker, one request at a time, disaggregated: the
prefill worker's KV, shipped as stored (codes and scales), and the decode worker's steps give
exactly what the offline engine with the same flags gives.

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


# The KV cache dtype, and what the workers' start line calls it.
KV_CACHES = {"auto": "float32", "fp8": "float8_e4m3fn"}


@pytest.fixture(scope="module", params=list(KV_CACHES))
def int8_cluster(
    request: pytest.FixtureRequest,
    redis_url: str,
    checkpoint: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[LocalCluster, str]]:
    kv_args = () if request.param == "auto" else ("--kv-cache-dtype", request.param)
    for cluster in running_cluster(
        redis_url,
        checkpoint,
        tmp_path_factory,
        num_prefill=1,
        num_decode=1,
        worker_args=(*WORKER_ARGS, "--quantization", "int8", *kv_args),
    ):
        yield cluster, request.param


def test_a_disaggregated_int8_cluster_matches_the_offline_int8_engine(
    int8_cluster: tuple[LocalCluster, str], checkpoint: Path
) -> None:
    cluster, kv_cache_dtype = int8_cluster
    offline = LLM(
        str(checkpoint),
        dtype="float32",
        num_kv_blocks=256,
        quantization="int8",
        kv_cache_dtype=kv_cache_dtype,
    )
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused")
    baseline = idle_free_blocks(cluster)
    for prompt in PROMPTS:
        (expected,) = offline.generate([prompt], greedy, use_tqdm=False)
        served = client.completions.create(
            model=model_name(cluster),
            prompt=prompt,
            max_tokens=20,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        assert served.choices[0].text == expected.outputs[0].text
    # The workers really run int8 (and the 8-bit cache): their logs say so.
    for role in ("prefill-0", "decode-0"):
        log = cluster.worker(role).log_path.read_text()
        assert "int8 weights" in log
        assert f"tokens ({KV_CACHES[kv_cache_dtype]}," in log
    assert idle_free_blocks(cluster) == baseline
