"""End to end through real processes: gateway -> prefill -> KV over UCX -> decode -> client.

Greedy outputs must be token-identical to the offline engine on the same checkpoint; blocks must
come back on every path (finish, client disconnect, expired lease); workers join and leave while
the cluster serves.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import redis
from openai.types import Completion

from nori.engine.llm import LLM
from nori.launch.local_cluster import LocalCluster
from nori.sampling.params import SamplingParams
from nori.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc
from tests.cluster.conftest import LEASE_S

PROMPTS = [
    "Once upon a time",
    "The little dog ran to the",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 3,
    "Hello",
    "In a small village there lived an old man who",
    "1 2 3 4 5 6 7 8 9 10",
    "She looked at the sky and said",
    "x",
]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def offline(checkpoint: Path) -> LLM:
    return LLM(str(checkpoint), dtype="float32", num_kv_blocks=512)


def model_name(cluster: LocalCluster) -> str:
    return Path(cluster.spec.model).name


def stats(cluster: LocalCluster, name: str) -> common_pb2.WorkerStats:
    worker = cluster.worker(name)
    with grpc.insecure_channel(worker.grpc_address) as channel:
        stub: prefill_pb2_grpc.PrefillServiceStub | decode_pb2_grpc.DecodeServiceStub
        if name.startswith("prefill"):
            stub = prefill_pb2_grpc.PrefillServiceStub(channel)
        else:
            stub = decode_pb2_grpc.DecodeServiceStub(channel)
        result: common_pb2.WorkerStats = stub.GetStats(common_pb2.StatsRequest(), timeout=5)
        return result


def live_workers(cluster: LocalCluster) -> list[str]:
    return [p.name for p in cluster.processes if p.name != "gateway" and p.process.poll() is None]


def wait_for_free_blocks(
    cluster: LocalCluster, expected: dict[str, int], timeout_s: float = 20.0
) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    while True:
        now = {name: stats(cluster, name).num_free_blocks for name in expected}
        if now == expected or time.monotonic() > deadline:
            return now
        time.sleep(0.1)


def idle_free_blocks(cluster: LocalCluster) -> dict[str, int]:
    names = live_workers(cluster)
    for name in names:
        deadline = time.monotonic() + 20
        while stats(cluster, name).num_requests_holding_blocks and time.monotonic() < deadline:
            time.sleep(0.1)
    return {name: stats(cluster, name).num_free_blocks for name in names}


def client(cluster: LocalCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0)


def greedy_completion(
    openai_client: openai.OpenAI, model: str, prompt: str, max_tokens: int
) -> Completion:
    """A greedy completion of exactly `max_tokens` tokens, as the offline engine's
    `SamplingParams(temperature=0, ignore_eos=True)` computes it."""
    return openai_client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )


def test_concurrent_greedy_completions_are_token_identical_to_offline(
    cluster: LocalCluster, offline: LLM
) -> None:
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=0)
    expected = [output.outputs[0] for output in offline.generate(PROMPTS, params)]

    def complete(prompt: str) -> dict[str, object]:
        response = httpx.post(
            f"{cluster.url}/v1/completions",
            json={
                "model": model_name(cluster),
                "prompt": prompt,
                "max_tokens": 24,
                "temperature": 0,
                "logprobs": 0,
                # Exact ids in the logprobs (vLLM's extension), not their text.
                "return_tokens_as_token_ids": True,
            },
            timeout=60,
        )
        assert response.status_code == 200, response.text
        return dict(response.json())

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(complete, PROMPTS))
    for result, reference in zip(results, expected, strict=True):
        choice = result["choices"][0]  # type: ignore[index]
        want_tokens = [f"token_id:{t}" for t in reference.token_ids]
        assert choice["logprobs"]["tokens"] == want_tokens
        assert choice["text"] == reference.text
        assert choice["finish_reason"] == reference.finish_reason
        usage = result["usage"]
        assert usage["completion_tokens"] == len(reference.token_ids)  # type: ignore[index]

    decodes = [stats(cluster, name) for name in ("decode-0", "decode-1")]
    assert all(s.num_requests > 0 for s in decodes), "both decode workers get requests"
    assert all(s.kv_bytes_received > 0 for s in decodes)
    prefill = stats(cluster, "prefill-0")
    assert prefill.kv_bytes_sent == sum(s.kv_bytes_received for s in decodes)
    # Each request's state history is in Redis, with a TTL.
    store = redis.Redis.from_url(cluster.spec.redis_url, decode_responses=True)
    key = f"{cluster.spec.namespace}:request:{results[0]['id']}-0"
    deadline = time.monotonic() + 5
    while "t_finished" not in store.hgetall(key) and time.monotonic() < deadline:
        time.sleep(0.05)
    history = store.hgetall(key)
    for state in ("queued", "prefilling", "transferring", "decoding", "finished"):
        assert f"t_{state}" in history, history
    assert history["state"] == "finished" and store.pttl(key) > 0
    store.close()
    metrics = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    assert 'nori_worker_kv_bytes_received_total{worker_id="decode-0",role="decode"}' in metrics


def test_openai_client_streaming_and_not_completions_and_chat(
    cluster: LocalCluster, offline: LLM
) -> None:
    api = client(cluster)
    name = model_name(cluster)
    params = SamplingParams(max_tokens=20, temperature=0.0)
    prompt = PROMPTS[4]
    reference = offline.generate([prompt], params)[0].outputs[0]

    completion = api.completions.create(model=name, prompt=prompt, max_tokens=20, temperature=0)
    assert completion.choices[0].text == reference.text
    streamed = api.completions.create(
        model=name,
        prompt=prompt,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage = [], None
    for chunk in streamed:
        pieces.extend(choice.text for choice in chunk.choices)
        usage = chunk.usage or usage
    assert "".join(pieces) == reference.text
    assert usage is not None and usage.completion_tokens == len(reference.token_ids)

    messages = [{"role": "user", "content": "Tell me a story about a cat."}]
    chat_reference = offline.chat([messages], params)[0].outputs[0]
    chat = api.chat.completions.create(
        model=name,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=20,
        temperature=0,
    )
    assert chat.choices[0].message.content == chat_reference.text
    chat_stream = api.chat.completions.create(
        model=name,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=20,
        temperature=0,
        stream=True,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chat_stream if chunk.choices)
    assert text == chat_reference.text

    with pytest.raises(openai.NotFoundError):
        api.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        api.completions.create(model=name, prompt="hi", max_tokens=10**6)


def test_n_seeded_choices_each_match_the_offline_engine(
    cluster: LocalCluster, offline: LLM
) -> None:
    # Each choice crosses the hand-off with its own seeded sampler (seed, seed + 1, ...).
    prompt = PROMPTS[1]
    answer = client(cluster).completions.create(
        model=model_name(cluster), prompt=prompt, n=3, seed=99, temperature=1.0, max_tokens=12,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    # Choice i samples with seed 99 + i, as LLM.generate's completion i does with n=3.
    params = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=99, ignore_eos=True)
    [reference] = offline.generate([prompt], params)
    for choice in answer.choices:
        assert choice.text == reference.outputs[choice.index].text, choice.index
    assert answer.usage is not None and answer.usage.completion_tokens == 36


def test_streaming_client_that_disconnects_frees_blocks_everywhere(cluster: LocalCluster) -> None:
    baseline = idle_free_blocks(cluster)
    body = {
        "model": model_name(cluster),
        "prompt": PROMPTS[2],
        "max_tokens": 3000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", f"{cluster.url}/v1/completions", json=body) as response,
    ):
        assert response.status_code == 200
        held: dict[str, int] = {}
        for line in response.iter_lines():
            if line.startswith("data: "):
                # Still reading (leaving the loop closes the stream): the request is decoding.
                held = {name: stats(cluster, name).num_requests_holding_blocks for name in baseline}
                break
        assert sum(held.values()) == 1, f"the request holds blocks on one worker: {held}"
    # Leaving the block closed the connection mid-stream.
    assert wait_for_free_blocks(cluster, baseline) == baseline


def test_lease_frees_blocks_when_the_kv_never_arrives(cluster: LocalCluster) -> None:
    baseline = idle_free_blocks(cluster)
    prefill = cluster.worker("prefill-0").process
    os.kill(prefill.pid, signal.SIGSTOP)  # a hung prefill worker: it never sends the KV
    try:
        started = time.monotonic()
        response = httpx.post(
            f"{cluster.url}/v1/completions",
            json={"model": model_name(cluster), "prompt": "Once upon a time", "max_tokens": 8},
            timeout=60,
        )
        elapsed = time.monotonic() - started
        assert response.status_code == 504, response.text
        assert "lease" in response.json()["error"]["message"]
        assert elapsed < LEASE_S + 10
        decodes = {name: count for name, count in baseline.items() if name.startswith("decode")}
        assert wait_for_free_blocks(cluster, decodes) == decodes
    finally:
        os.kill(prefill.pid, signal.SIGCONT)
    assert wait_for_free_blocks(cluster, baseline) == baseline
    # Its heartbeats stopped while it hung, so the registry dropped it; it re-joins by itself.
    cluster.wait_healthy({"prefill": 1, "decode": 2}, timeout_s=30)
    ok = httpx.post(
        f"{cluster.url}/v1/completions",
        json={"model": model_name(cluster), "prompt": "Hello", "max_tokens": 4},
        timeout=60,
    )
    assert ok.status_code == 200, ok.text


def test_a_decode_worker_joins_at_run_time_and_one_drains_on_sigterm(
    cluster: LocalCluster,
) -> None:
    cluster.add_worker("decode", "decode-2")
    cluster.wait_healthy({"prefill": 1, "decode": 3}, timeout_s=120)

    def complete(prompt: str) -> int:
        response = httpx.post(
            f"{cluster.url}/v1/completions",
            json={"model": model_name(cluster), "prompt": prompt, "max_tokens": 8},
            timeout=60,
        )
        return response.status_code

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        assert list(pool.map(complete, PROMPTS[:6])) == [200] * 6
    assert stats(cluster, "decode-2").num_requests > 0, "the new worker takes requests"

    # A long streaming request; SIGTERM the decode worker serving it: it must finish first.
    body = {
        "model": model_name(cluster),
        "prompt": PROMPTS[1],
        "max_tokens": 2000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(timeout=120) as http,
        http.stream("POST", f"{cluster.url}/v1/completions", json=body) as response,
    ):
        lines = response.iter_lines()
        first = [next(lines) for _ in range(4)]
        assert any(line.startswith("data: ") for line in first)
        serving = [
            name
            for name in ("decode-0", "decode-1", "decode-2")
            if stats(cluster, name).num_running
        ]
        assert len(serving) == 1
        worker = cluster.worker(serving[0]).process
        worker.send_signal(signal.SIGTERM)
        rest = list(lines)
    assert rest[-2:] == ["data: [DONE]", ""] or rest[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in "".join(rest).replace(" ", "")
    assert worker.wait(timeout=60) == 0
    assert complete("after the drain") == 200


def test_the_gateway_process_never_loads_torch(cluster: LocalCluster) -> None:
    # After serving a completion, a chat (streamed) and its logprobs: every gateway code path a
    # request takes has run, and none of it mapped PyTorch's libraries into the process.
    chat = client(cluster).chat.completions.create(
        model=model_name(cluster),
        messages=[{"role": "user", "content": "Once upon a time"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
        stream=True,
    )
    assert any(chunk.choices for chunk in chat)
    completion = client(cluster).completions.create(
        model=model_name(cluster), prompt="Lily", max_tokens=4, logprobs=1
    )
    assert completion.choices[0].finish_reason in ("stop", "length")
    gateway = cluster.worker("gateway").process
    maps = Path(f"/proc/{gateway.pid}/maps").read_text()
    assert "libtorch" not in maps
    # ... while a worker does map it, so the check looks at the right thing.
    # (An earlier test may have stopped decode-0: look at a live one.)
    worker = cluster.worker(live_workers(cluster)[0]).process
    assert "libtorch" in Path(f"/proc/{worker.pid}/maps").read_text()


def test_a_worker_with_another_block_size_is_refused(cluster: LocalCluster) -> None:
    # The gateway learns the block size from the registry; a prefill worker that joins with
    # another one would compute KV the decode workers cannot take, so it gets no request.
    odd = cluster.add_worker("prefill", "prefill-odd", extra_args=["--block-size", "32"])
    gateway_log = cluster.worker("gateway").log_path
    try:
        deadline = time.monotonic() + 120
        while "refusing worker prefill-odd" not in gateway_log.read_text(errors="replace"):
            assert odd.process.poll() is None, odd.log_tail()
            assert time.monotonic() < deadline, "the gateway never refused prefill-odd"
            time.sleep(0.2)
        line = next(
            line
            for line in gateway_log.read_text(errors="replace").splitlines()
            if "refusing worker prefill-odd" in line
        )
        assert "its KV blocks are 32 tokens of float32, the cluster's are 16 tokens" in line
        assert httpx.get(f"{cluster.url}/health").json()["workers"]["prefill"] == 1
        for prompt in PROMPTS[:4]:
            completion = client(cluster).completions.create(
                model=model_name(cluster), prompt=prompt, max_tokens=4
            )
            assert completion.choices[0].finish_reason in ("stop", "length")
        assert stats(cluster, "prefill-odd").num_requests == 0
        # One line per refused worker, not one per registry read.
        text = gateway_log.read_text(errors="replace")
        assert text.count("refusing worker prefill-odd") == 1
    finally:
        odd.process.terminate()
        odd.process.wait(30)
        cluster.processes.remove(odd)
