"""KV corrupted in flight, end to end: the decode worker refuses it and nothing is decoded on it.

The prefill worker runs with a `sitecustomize` (test-only, on its PYTHONPATH) that flips one
byte of its first transfer right after the transfer's checksum has taken it in, as a bad link or
a buggy NIC would. The decode worker's check fails, its blocks are freed, the gateway computes the
prompt again, and the client gets the undisturbed greedy completion with HTTP 200.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from nori.engine.llm import LLM
from nori.launch.local_cluster import LocalCluster
from nori.sampling.params import SamplingParams
from tests.cluster.conftest import start_cluster
from tests.cluster.test_cluster_e2e import idle_free_blocks, model_name

pytestmark = pytest.mark.slow

# Runs at the start of every process on the PYTHONPATH; acts only in a prefill worker.
CORRUPTING_SITECUSTOMIZE = """
import sys

if sys.argv[1:3] == ["serve", "prefill"]:
    import torch

    from nori.prefill import export_arena

    _read_blocks = export_arena.ExportArena.read_blocks
    _copies = []

    def _corrupting_read_blocks(self, tensors, block_ids):
        # The export copy's bytes change by one flipped byte after it took their checksum:
        # corruption between the checksum and the wire (the receiver copies them out of the
        # arena, or gets them as messages), in the first transfer only (the retry goes through
        # intact).
        copy = _read_blocks(self, tensors, block_ids)
        if not _copies:
            _copies.append(True)
            assert copy.checksum is not None, "the copy took no checksum: nothing to corrupt"
            copy.blocks[0].view(torch.uint8).view(-1)[0] ^= 0xFF
        return copy

    export_arena.ExportArena.read_blocks = _corrupting_read_blocks
"""


@pytest.fixture(scope="module")
def corrupting_cluster(
    redis_url: str, checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    hooks = tmp_path_factory.mktemp("hooks")
    (hooks / "sitecustomize.py").write_text(CORRUPTING_SITECUSTOMIZE)
    with pytest.MonkeyPatch.context() as patch:
        # Every role inherits it at spawn; only the prefill worker acts on it.
        patch.setenv("PYTHONPATH", os.pathsep.join([str(hooks), os.environ.get("PYTHONPATH", "")]))
        running = start_cluster(
            redis_url, checkpoint, tmp_path_factory.mktemp("logs"), num_prefill=1, num_decode=1
        )
    try:
        yield running
    finally:
        running.stop()


def test_a_corrupted_transfer_is_refused_and_the_request_computed_again(
    corrupting_cluster: LocalCluster, checkpoint: Path
) -> None:
    cluster = corrupting_cluster
    baseline = idle_free_blocks(cluster)
    prompt = "Once upon a time there was a little cat who liked to play in the garden."
    offline = LLM(str(checkpoint), dtype="float32", num_kv_blocks=256)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = offline.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].text

    response = httpx.post(
        f"{cluster.url}/v1/completions",
        json={
            "model": model_name(cluster),
            "prompt": prompt,
            "max_tokens": 24,
            "temperature": 0.0,
            "ignore_eos": True,
        },
        timeout=120,
    )
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == expected
    gateway_log = cluster.worker("gateway").log_path.read_text()
    assert "corrupted KV transfer" in gateway_log and "computing it again" in gateway_log
    assert idle_free_blocks(cluster) == baseline
