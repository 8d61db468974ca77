"""A mixture-of-experts model through a disaggregated cluster: real Redis, the gateway, a prefill
and a decode worker (`nori serve`), KV blocks over UCX (or TCP), the openai client.

The checkpoint is transformers' own tiny Qwen2-MoE (routed experts, a shared expert, a dense
layer; `tests/engine/moe_checkpoints.py`). Greedy completions must be the offline engine's, whose
tokens are themselves checked against transformers here: with both pools on one rank, and with
one pool on 2 ranks with expert parallelism (`--prefill-args '-tp 2 --enable-expert-parallel'`,
then the decode pool so) beside the other on one rank: the KV layout is the same either way, so
the blocks a pool sends are those the other takes. Every KV block comes back at the end.
"""

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
from tests.cluster.test_cluster_e2e import greedy_completion, idle_free_blocks, model_name
from tests.engine.moe_checkpoints import write_moe_checkpoint
from tests.engine.reference import hf_greedy

pytestmark = pytest.mark.slow

PROMPTS = ["Once upon a time there was a cat", "The weather today is", "A B C D E F G H I J K"]
NEW_TOKENS = 16
EXPERT_PARALLEL = ("--tensor-parallel-size", "2", "--enable-expert-parallel")
# Which pool runs on 2 ranks with expert parallelism (None: both on one).
LAYOUTS = {"one-rank": None, "prefill-ep": "prefill", "decode-ep": "decode"}


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_moe_checkpoint(tmp_path_factory.mktemp("qwen2-moe"), "qwen2_moe")


@pytest.fixture(scope="module")
def expected_texts(moe_checkpoint: Path) -> list[str]:
    """The offline engine's greedy completions, after checking its tokens against
    transformers' (so the cluster is held to transformers, not merely to Nori)."""
    offline = LLM(str(moe_checkpoint), dtype="float32", num_kv_blocks=256)
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = offline.generate(PROMPTS, greedy, use_tqdm=False)
    prompt_ids = [list(output.prompt_token_ids) for output in outputs]
    reference = hf_greedy(moe_checkpoint, prompt_ids, NEW_TOKENS)
    for output, want in zip(outputs, reference, strict=True):
        assert output.outputs[0].token_ids == want.tokens
    return [output.outputs[0].text for output in outputs]


@pytest.fixture(scope="module", params=list(LAYOUTS))
def moe_cluster(
    request: pytest.FixtureRequest,
    redis_url: str,
    moe_checkpoint: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[LocalCluster, str | None]]:
    """A 1 prefill + 1 decode cluster, and which pool (if any) splits its experts."""
    split_pool = LAYOUTS[request.param]
    pool_args = {} if split_pool is None else {f"{split_pool}_args": EXPERT_PARALLEL}
    for cluster in running_cluster(
        redis_url, moe_checkpoint, tmp_path_factory, num_prefill=1, num_decode=1, **pool_args
    ):
        yield cluster, split_pool


def test_moe_completions_through_the_cluster_match_transformers(
    moe_cluster: tuple[LocalCluster, str | None], expected_texts: list[str]
) -> None:
    cluster, split_pool = moe_cluster
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0)
    baseline = idle_free_blocks(cluster)

    def complete(prompt: str) -> tuple[str, int]:
        response = greedy_completion(client, model_name(cluster), prompt, NEW_TOKENS)
        assert response.usage is not None
        return response.choices[0].text, response.usage.completion_tokens

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        served = list(pool.map(complete, PROMPTS))
    assert [text for text, _ in served] == expected_texts
    assert all(count == NEW_TOKENS for _, count in served)
    for name in ("prefill-0", "decode-0"):
        log = cluster.worker(name).log_path.read_text()
        split = "rank 0 of 2, expert parallel" in log
        assert split == (name == f"{split_pool}-0"), name
    assert idle_free_blocks(cluster) == baseline
