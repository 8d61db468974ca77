"""`nori up` takes what `vllm serve` takes: the model as a positional, the engine options (passed
to every worker), -v after the subcommand, and --help with defaults."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nori.cli.engine_args import changed_engine_flags, role_prefill_budget, worker_args
from nori.cli.main import build_parser


def test_engine_options_given_to_up_reach_every_worker() -> None:
    args = build_parser().parse_args(
        ["up", "stories", "--max-model-len", "256", "--no-prefix-caching", "--dtype", "float32"]
    )
    assert args.model_tag == "stories"
    flags = changed_engine_flags(args, args.engine_actions)
    assert flags == ["--dtype", "float32", "--max-model-len", "256", "--no-prefix-caching"]
    assert worker_args(" ".join(flags)) == tuple(flags)  # what a worker's parser accepts
    untouched = build_parser().parse_args(["up"])
    assert changed_engine_flags(untouched, untouched.engine_actions) == []


def test_the_prefill_budget_is_uncapped_unless_asked() -> None:
    """Serving takes prompts uncapped (throughput first) on a colocated worker and in chunks on
    a decode worker, unless told: what `nori up` is told, 0 included, is passed on to every
    worker (0 used to be dropped as the default, and the decode workers chunked anyway)."""
    unset = build_parser().parse_args(["up"])
    assert changed_engine_flags(unset, unset.engine_actions) == []
    uncapped = build_parser().parse_args(["up", "--prefill-budget-with-decodes", "0"])
    assert uncapped.prefill_budget_with_decodes is None
    assert changed_engine_flags(uncapped, uncapped.engine_actions) == [
        "--prefill-budget-with-decodes",
        "0",
    ]
    auto = build_parser().parse_args(["up", "--prefill-budget-with-decodes", "auto"])
    assert changed_engine_flags(auto, auto.engine_actions) == [
        "--prefill-budget-with-decodes",
        "auto",
    ]
    # A decode worker chunks the prompts it computes beside its streams, unless told otherwise;
    # a colocated one takes them uncapped.
    serve = build_parser().parse_args(["serve", "decode"])
    assert role_prefill_budget(serve.prefill_budget_with_decodes, colocated=False) == "auto"
    assert role_prefill_budget(serve.prefill_budget_with_decodes, colocated=True) is None
    given = build_parser().parse_args(["serve", "decode", "--prefill-budget-with-decodes", "0"])
    assert role_prefill_budget(given.prefill_budget_with_decodes, colocated=False) is None
    given = build_parser().parse_args(["serve", "decode", "--prefill-budget-with-decodes", "64"])
    assert role_prefill_budget(given.prefill_budget_with_decodes, colocated=False) == 64


@pytest.mark.parametrize("argv", [["-v", "up"], ["up", "-v"], ["serve", "decode", "--verbose"]])
def test_verbose_goes_before_or_after_the_subcommand(argv: list[str]) -> None:
    assert build_parser().parse_args(argv).verbose is True
    quiet = [arg for arg in argv if arg not in ("-v", "--verbose")]
    assert build_parser().parse_args(quiet).verbose is False


def test_help_shows_the_defaults() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "nori.cli.main", "up", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    assert "--port PORT the gateway's HTTP port (default: 8000)" in text
    assert "--max-num-seqs MAX_NUM_SEQS most running sequences (default: 256)" in text
    assert "MODEL the model, as `vllm serve MODEL` takes it" in text


def test_the_model_given_two_ways_is_refused() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "nori.cli.main", "up", "small", "--model", "demo2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr == "nori: error: the model is given twice: small and --model demo2\n"


def test_each_pool_may_get_engine_options_of_its_own() -> None:
    args = build_parser().parse_args(
        ["up", "--prefill-args", "-tp 2", "--decode-args", "--kv-cache-dtype int8"]
    )
    assert worker_args(args.prefill_args, "--prefill-args") == ("-tp", "2")
    assert worker_args(args.decode_args, "--decode-args") == ("--kv-cache-dtype", "int8")


def test_the_gateway_gets_the_disaggregation_options_of_up() -> None:
    """`nori up --disaggregation always --max-local-compute-s 0.3` reaches its gateway's command
    line; left at their defaults (auto, 0.1 s), neither is passed (the gateway's are the same)."""
    from nori.launch.local_cluster import ClusterSpec, LocalCluster
    from nori.settings import settings_from

    def gateway_options(argv: list[str]) -> list[str]:
        args = build_parser().parse_args(["up", *argv])
        spec = settings_from(
            ClusterSpec, args, redis_url="redis://127.0.0.1:1", num_prefill=1, num_decode=1
        )
        return LocalCluster(spec)._gateway_options()

    assert gateway_options(["--disaggregation", "always", "--max-local-compute-s", "0.3"]) == [
        "--disaggregation",
        "always",
        "--max-local-compute-s",
        "0.3",
    ]
    assert gateway_options([]) == []
    assert build_parser().parse_args(["up"]).disaggregation == "auto"
    assert build_parser().parse_args(["serve", "gateway"]).disaggregation == "auto"


def test_the_transport_is_ucx_or_tcp(capsys: pytest.CaptureFixture[str]) -> None:
    """No flag: each worker takes its default (ucx where ucxx imports); `auto` is gone."""
    assert build_parser().parse_args(["up"]).transport is None
    assert build_parser().parse_args(["serve", "decode", "--transport", "tcp"]).transport == "tcp"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "prefill", "--transport", "auto"])
    assert "--transport: invalid choice: 'auto'" in capsys.readouterr().err
