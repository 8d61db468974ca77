"""The generated nori.v1 code is current, and engine types cross the wire exactly."""

from __future__ import annotations

import dataclasses
import filecmp
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nori.engine.outputs import StepOutput
from nori.rpc.convert import (
    logprobs_from_proto,
    params_from_proto,
    params_to_proto,
    stop_reason_from_proto,
)
from nori.sampling.logprobs import TokenLogprobs
from nori.sampling.params import SamplingParams
from nori.v1 import common_pb2
from nori.worker.servicer_base import delta_from_output

ROOT = Path(__file__).resolve().parents[2]
PROTO = ROOT / "proto"
GENERATE = (
    "python -m grpc_tools.protoc -Iproto --python_out=proto --pyi_out=proto "
    "--grpc_python_out=proto proto/nori/v1/*.proto"
)


def test_generated_code_is_current(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    shutil.copytree(
        PROTO, tmp_path / "proto", ignore=shutil.ignore_patterns("*_pb2*", "__pycache__")
    )
    sources = sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "proto").rglob("*.proto"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-Iproto",
            "--python_out=proto",
            "--pyi_out=proto",
            "--grpc_python_out=proto",
            *sources,
        ],
        cwd=tmp_path,
        check=True,
    )
    generated = sorted((tmp_path / "proto/nori/v1").glob("*_pb2*"))
    assert len(generated) == 12
    for fresh in generated:
        checked_in = PROTO / "nori/v1" / fresh.name
        assert checked_in.is_file(), f"{checked_in} is missing; run: {GENERATE}"
        assert filecmp.cmp(fresh, checked_in, shallow=False), (
            f"{fresh.name} is stale; run: {GENERATE}"
        )


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(
            max_tokens=7,
            temperature=0.7,
            top_p=0.9,
            top_k=20,
            min_p=0.05,
            seed=-3,
            repetition_penalty=1.1,
            presence_penalty=-0.5,
            frequency_penalty=0.25,
            stop=["\n\n", "END"],
            stop_token_ids=[2, 5],
            include_stop_str_in_output=True,
            ignore_eos=True,
            min_tokens=3,
            logprobs=0,
            skip_special_tokens=False,
        ),
    ],
)
def test_sampling_params_round_trip_exactly(params: SamplingParams) -> None:
    wire = common_pb2.SamplingParams.FromString(params_to_proto(params).SerializeToString())
    assert params_from_proto(wire) == params


def test_the_wire_message_has_exactly_the_sampling_parameters() -> None:
    wire_fields = {field.name for field in common_pb2.SamplingParams.DESCRIPTOR.fields}
    # All but `n`: a prompt's n choices travel as n requests, each with n=1.
    assert wire_fields == {field.name for field in dataclasses.fields(SamplingParams)} - {"n"}


def test_invalid_params_on_the_wire_raise_value_error() -> None:
    with pytest.raises(ValueError, match="top_p"):
        params_from_proto(common_pb2.SamplingParams(max_tokens=4, top_p=0.0))


def test_output_delta_carries_the_new_tokens_logprobs_and_stop_reason() -> None:
    entries = [
        TokenLogprobs(token_id=5, logprob=-0.5, rank=1, top=((5, -0.5), (9, -1.5))),
        TokenLogprobs(token_id=7, logprob=-2.0, rank=3, top=((1, -0.25), (2, -1.0))),
    ]
    output = StepOutput(
        request_id="r",
        prompt_token_ids=[1, 2],
        token_ids=[5, 7],
        text="ab",
        new_token_ids=[7],
        new_text="b",
        finished=True,
        finish_reason="stop",
        stop_reason="END",
        logprobs=entries,
        num_cached_tokens=16,
    )
    delta = common_pb2.TokenDelta.FromString(delta_from_output(output).SerializeToString())
    assert list(delta.token_ids) == [7] and delta.text == "b"
    assert delta.finished and delta.finish_reason == "stop" and delta.num_cached_tokens == 16
    assert stop_reason_from_proto(delta) == "END"
    [entry] = [logprobs_from_proto(e) for e in delta.logprobs]
    assert entry.token_id == 7 and entry.rank == 3 and entry.top[0][0] == 1
    assert entry.logprob == pytest.approx(-2.0)

    by_token = StepOutput("r", [1], [5], "", [5], "", True, "stop", stop_reason=5)
    assert stop_reason_from_proto(delta_from_output(by_token)) == 5
    running = StepOutput("r", [1], [5], "", [5], "", False)
    assert stop_reason_from_proto(delta_from_output(running)) is None
