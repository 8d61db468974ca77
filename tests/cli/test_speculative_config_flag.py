"""--speculative-config (vLLM's spelling and keys) on every command that builds an engine: parsed
into the engine's config, passed on by `nori up` to each worker as given, a bad value one
`nori: error:` line (exit 2) before anything starts; and `LLM(speculative_config=...)`."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from nori.cli.engine_args import changed_engine_flags, engine_config_from_args, worker_args
from nori.cli.main import build_parser
from nori.engine.config import SpeculativeConfig

NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
NGRAM_CONFIG = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=4)


def nori(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nori.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "command",
    [
        ["serve", "prefill"],
        ["serve", "decode"],
        ["serve", "decode", "--colocated"],
        ["generate", "--prompt", "hi"],
        ["bench", "offline"],
    ],
)
def test_the_flag_becomes_the_engines_speculative_config(command: list[str]) -> None:
    args = build_parser().parse_args([*command, "--speculative-config", NGRAM])
    assert engine_config_from_args(args).speculative_config == NGRAM_CONFIG
    off = build_parser().parse_args(command)
    assert engine_config_from_args(off).speculative_config is None


def test_up_passes_the_flag_to_every_worker_as_a_worker_parses_it() -> None:
    """`nori up` hands every worker (prefill, decode, colocated) the same flags: worker_args."""
    args = build_parser().parse_args(["up", "--speculative-config", NGRAM])
    flags = changed_engine_flags(args, args.engine_actions)
    assert flags == ["--speculative-config", NGRAM]
    assert worker_args(shlex.join(flags)) == tuple(flags)  # survives the shell quoting
    worker = build_parser().parse_args(["serve", "decode", *flags])
    assert engine_config_from_args(worker).speculative_config == NGRAM_CONFIG
    untouched = build_parser().parse_args(["up"])
    assert changed_engine_flags(untouched, untouched.engine_actions) == []


@pytest.mark.parametrize("role", ["prefill", "decode", "colocated"])
def test_each_worker_states_its_settings_in_its_registry_entry(role: str) -> None:
    """What the gateway pairs workers by: the canonical JSON (key order and spacing as given do
    not matter), "" when off. The workers are built as `nori serve` builds them, not started."""
    from nori.cli.serve import _worker_options
    from nori.decode.servicer import DecodeWorker
    from nori.prefill.worker import PrefillWorker
    from nori.state.registry import WorkerInfo

    command = ["serve", "prefill"] if role == "prefill" else ["serve", "decode"]
    if role == "colocated":
        command.append("--colocated")
    reordered = '{"prompt_lookup_max":4,  "num_speculative_tokens":3,"method":"ngram"}'
    for flags, stated in [(["--speculative-config", reordered], NGRAM_CONFIG.as_json()), ([], "")]:
        args = build_parser().parse_args([*command, *flags])
        options, config = _worker_options(args), engine_config_from_args(args)
        if role == "prefill":
            worker = PrefillWorker(options, config, transport="tcp")
        else:
            worker = DecodeWorker(options, config, transport="tcp", colocated=args.colocated)
        entry = worker.info()
        assert entry.role == role and entry.speculative_config == stated
        assert WorkerInfo.from_mapping(entry.to_mapping()) == entry


def test_per_pool_args_with_a_bad_config_name_their_option() -> None:
    with pytest.raises(ValueError, match=r"^--decode-args: --speculative-config: .*num_spec"):
        worker_args('--speculative-config \'{"method": "ngram"}\'', "--decode-args")


BAD_JSON = "{method: ngram}"
WRONG_TYPE = '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": "x"}'
BAD = [
    (BAD_JSON, "--speculative-config: speculative config is not valid JSON"),
    (WRONG_TYPE, "--speculative-config: prompt_lookup_max must be an integer"),
    ('{"method": "medusa", "num_speculative_tokens": 2}', "method must be one of ngram"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "n": 1}', "unknown speculative config key"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', 'needs "model"'),
]
# Every check through `nori up` (the launcher, before it starts anything); the flag's own
# handling through the others (the config's checks are the same code there).
CASES = [
    *((["up"], value, message) for value, message in BAD),
    *(
        (command, value, message)
        for command in (["serve", "prefill"], ["serve", "decode"], ["generate", "--prompt", "x"])
        for value, message in BAD[:2]
    ),
]


@pytest.mark.parametrize(("command", "value", "message"), CASES)
def test_a_bad_config_is_one_clear_line(command: list[str], value: str, message: str) -> None:
    result = nori(*command, "--speculative-config", value)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("nori: error: --speculative-config: "), result.stderr
    assert message in result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_up_refuses_pools_that_would_not_pair() -> None:
    """Per-pool args giving prefill and decode different settings: said before starting, not
    found out as a cluster that never becomes healthy."""
    four = NGRAM.replace("3", "4")
    result = nori("up", "--port", "0", "--speculative-config", NGRAM, "--decode-args",
                  f"--speculative-config '{four}'")  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr == (
        "nori: error: the prefill workers' --speculative-config "
        f"({SpeculativeConfig.parse(NGRAM).as_json()}) differs from the decode workers' "
        f"({SpeculativeConfig.parse(four).as_json()}); the gateway pairs only workers that agree\n"
    )
    off = nori("up", "--port", "0", "--prefill-args", f"--speculative-config '{NGRAM}'")
    assert off.returncode == 2 and "differs from the decode workers' (off)" in off.stderr


@pytest.mark.parametrize("command", [["up"], ["serve", "prefill"], ["serve", "decode"]])
def test_help_lists_the_flag_with_an_example(command: list[str]) -> None:
    result = nori(*command, "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert "--speculative-config JSON speculative decoding" in text
    assert """'{"method": "ngram", "num_speculative_tokens": 4""" in text


def test_llm_takes_a_dict_json_text_or_a_config_and_refuses_a_bad_one(tmp_path: Path) -> None:
    from nori.engine.llm import LLM
    from nori.models.init_checkpoint import init_checkpoint

    for bad, message in [
        ('{"method": "ngram"', "not valid JSON"),
        ({"method": "ngram", "num_speculative_tokens": "2"}, "num_speculative_tokens must be"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": "1"}, "an integer"),
        ([("method", "ngram")], "must be a JSON object"),
    ]:
        with pytest.raises(ValueError, match=message):  # before any model is looked for
            LLM("/no/such/model", speculative_config=bad)  # type: ignore[arg-type]
    init_checkpoint(tmp_path, "tiny", seed=3)
    for given in (NGRAM, json.loads(NGRAM), NGRAM_CONFIG):
        llm = LLM(str(tmp_path), dtype="float32", num_kv_blocks=16, speculative_config=given)
        assert llm.engine.config.speculative_config == NGRAM_CONFIG
    assert LLM(str(tmp_path), num_kv_blocks=16).engine.config.speculative_config is None
