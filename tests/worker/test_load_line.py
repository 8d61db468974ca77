"""The periodic load line a busy worker logs."""

from __future__ import annotations

from nori.engine.outputs import EngineLoad
from nori.worker.runtime import load_line


def test_the_load_line_says_throughput_queue_kv_use_and_new_requests() -> None:
    load = EngineLoad(
        num_running=12, num_waiting=3, num_held=2, num_free_blocks=750, num_total_blocks=1000
    )
    assert load_line(load, 40, 10.0, prompt_tokens=5120, generated_tokens=8005) == (
        "prompt 512.0 tokens/s, generation 800.5 tokens/s; "
        "12 running, 3 waiting, 2 held; KV blocks 250/1000 used (25.0%); 40 new requests in 10 s"
    )
    assert "0/0 used (0.0%)" in load_line(EngineLoad(), 0, 10.0)
