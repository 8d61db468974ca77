"""Random traffic through a real engine (tiny model): no leaked block, whatever the path.

Requests arrive, run, get aborted mid-prefill or mid-decode, stop on tokens, or go prefill-only
and are exported, imported into a second engine or released. After every action both engines'
block managers must be consistent, and once everything has ended every block is free again.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nori.engine.engine import LLMEngine
from nori.engine.llm import LLM
from nori.engine.request import KVToRemote
from nori.models.init_checkpoint import init_checkpoint
from nori.sampling.params import SamplingParams

NUM_BLOCKS = 24


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> tuple[LLMEngine, LLMEngine]:
    folder = tmp_path_factory.mktemp("tiny")
    init_checkpoint(folder, "tiny", seed=8)
    options = {"dtype": "float32", "block_size": 4, "num_kv_blocks": NUM_BLOCKS}
    prefill = LLM(str(folder), max_num_batched_tokens=16, **options).engine  # type: ignore[arg-type]
    decode = LLM(str(folder), max_num_seqs=3, **options).engine  # type: ignore[arg-type]
    return prefill, decode


actions = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.integers(1, 30),  # prompt length
            st.integers(1, 12),  # max_tokens
            st.booleans(),  # prefill only
            st.sampled_from([0.0, 1.0]),  # temperature
        ),
        st.tuples(st.just("step"), st.integers(1, 3)),
        st.tuples(st.just("abort"), st.integers(0, 40)),
        st.tuples(st.just("transfer"), st.integers(0, 40)),
    ),
    max_size=30,
)


def check(engine: LLMEngine) -> None:
    engine.kv_cache.check_invariants()


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(actions=actions)
def test_random_traffic_never_leaks_blocks(
    engines: tuple[LLMEngine, LLMEngine], actions: list[tuple]
) -> None:
    prefill, decode = engines
    names: list[str] = []
    for action in actions:
        kind = action[0]
        if kind == "add":
            _, length, max_tokens, prefill_only, temperature = action
            name = f"r{len(names)}-{id(actions)}"
            names.append(name)
            params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=len(names))
            prompt = [(7 * len(names) + i) % 500 + 3 for i in range(length)]
            remote_kv = KVToRemote() if prefill_only else None
            prefill.add_request(name, prompt, params, remote_kv=remote_kv)
        elif kind == "step":
            for _ in range(action[1]):
                prefill.step()
                decode.step()
        elif names:
            name = names[action[1] % len(names)]
            if kind == "abort":
                prefill.abort_request(name)
                decode.abort_request(name)
            else:
                try:
                    export = prefill.export_request(name)
                except ValueError:
                    pass  # not (or no longer) a prefilled request
                else:
                    prefill.finish_kv_transfer(name)
                    decode.import_request(export)  # False (pool full) simply drops it
        check(prefill)
        check(decode)

    for name in names:
        prefill.abort_request(name)
        decode.abort_request(name)
    for engine in (prefill, decode):
        check(engine)
        assert engine.load().num_free_blocks == NUM_BLOCKS
        assert not engine.has_unfinished_requests()
        # Nothing is still tracked: every id can be added again.
        for name in names:
            engine.add_request(name, [1], SamplingParams(max_tokens=1))
            engine.abort_request(name)
