"""The CPU plan of a local cluster: exact CPU sets and thread counts, overrides, bad lists."""

from __future__ import annotations

import os

import pytest

from nori.launch.cpu_plan import (
    CpuPlan,
    CpuRequest,
    format_cpu_list,
    parse_cpu_list,
    plan_cpus,
    spread,
)
from nori.worker.cpu_binding import CpuBinding


def layout(plan: CpuPlan) -> dict[str, tuple[str, int]]:
    """name -> (CPU list, threads): what `nori up` prints."""
    return {p.name: (p.cpu_list, p.threads) for p in plan.placements}


def plan(num_cpus: int, **request: object) -> dict[str, tuple[str, int]]:
    return layout(plan_cpus(range(num_cpus), CpuRequest(**request)))  # type: ignore[arg-type]


# ---------------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    ("text", "cpus"),
    [
        ("0", {0}),
        ("0-3,6", {0, 1, 2, 3, 6}),
        ("6, 0-1", {0, 1, 6}),
        ("0-7:2", {0, 2, 4, 6}),
        ("3-3", {3}),
        ("1,1,0-1", {0, 1}),
    ],
)
def test_parse_cpu_list(text: str, cpus: set[int]) -> None:
    assert parse_cpu_list(text) == frozenset(cpus)


@pytest.mark.parametrize("text", ["", "a", "0-", "-1", "3-1", "0,,1", "0-3:0", "1.5", "0-x"])
def test_bad_cpu_lists_name_the_flag_and_the_text(text: str) -> None:
    with pytest.raises(ValueError, match=f"^--cpus-decode {text!r}: ") as error:
        parse_cpu_list(text, "--cpus-decode")
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("cpus", "text"),
    [({0}, "0"), ({0, 1, 2, 3, 6}, "0-3,6"), ({5, 1, 3}, "1,3,5"), ({0, 1, 3, 4}, "0-1,3-4")],
)
def test_format_cpu_list(cpus: set[int], text: str) -> None:
    assert format_cpu_list(cpus) == text
    assert parse_cpu_list(text) == frozenset(cpus)


# ---------------------------------------------------------------------- default plans


def test_two_cores_prefill_and_decode_one_each() -> None:
    assert plan(2) == {"prefill-0": ("0", 1), "decode-0": ("1", 1), "gateway": ("0", 1)}


def test_two_cores_colocated_gets_both() -> None:
    assert plan(2, colocated=True) == {"colocated-0": ("0-1", 2), "gateway": ("0-1", 1)}


def test_one_core_everything_shares_it() -> None:
    assert plan(1, num_prefill=2, num_decode=3) == {
        "prefill-0": ("0", 1),
        "prefill-1": ("0", 1),
        "decode-0": ("0", 1),
        "decode-1": ("0", 1),
        "decode-2": ("0", 1),
        "gateway": ("0", 1),
    }
    assert plan(1, colocated=True) == {"colocated-0": ("0", 1), "gateway": ("0", 1)}


def test_four_cores() -> None:
    assert plan(4) == {"prefill-0": ("0-1", 2), "decode-0": ("2-3", 2), "gateway": ("0-1", 1)}
    assert plan(4, num_decode=2) == {
        "prefill-0": ("0", 1),
        "decode-0": ("1-2", 2),
        "decode-1": ("3", 1),
        "gateway": ("0", 1),
    }
    # Five workers on four cores: the two prefill workers share the prefill pool's one CPU.
    assert plan(4, num_prefill=2, num_decode=3) == {
        "prefill-0": ("0", 1),
        "prefill-1": ("0", 1),
        "decode-0": ("1", 1),
        "decode-1": ("2", 1),
        "decode-2": ("3", 1),
        "gateway": ("0", 1),
    }
    assert plan(4, colocated=True) == {"colocated-0": ("0-3", 4), "gateway": ("0-3", 1)}


def test_sixteen_cores() -> None:
    assert plan(16) == {"prefill-0": ("0-7", 8), "decode-0": ("8-15", 8), "gateway": ("0-7", 1)}
    assert plan(16, num_prefill=2, num_decode=3) == {
        "prefill-0": ("0-2", 3),
        "prefill-1": ("3-5", 3),
        "decode-0": ("6-9", 4),
        "decode-1": ("10-12", 3),
        "decode-2": ("13-15", 3),
        "gateway": ("0-5", 1),
    }
    assert plan(16, num_prefill=3, num_decode=1) == {
        "prefill-0": ("0-3", 4),
        "prefill-1": ("4-7", 4),
        "prefill-2": ("8-11", 4),
        "decode-0": ("12-15", 4),
        "gateway": ("0-11", 1),
    }
    assert plan(16, colocated=True) == {"colocated-0": ("0-15", 16), "gateway": ("0-15", 1)}


@pytest.mark.parametrize("num_cpus", [1, 2, 3, 4, 5, 8, 16])
@pytest.mark.parametrize("num_prefill", [1, 2, 3])
@pytest.mark.parametrize("num_decode", [1, 2, 3])
def test_every_layout_is_planned_within_the_usable_cpus(
    num_cpus: int, num_prefill: int, num_decode: int
) -> None:
    result = plan_cpus(range(num_cpus), CpuRequest(num_prefill, num_decode))
    names = [p.name for p in result.placements]
    assert names == [
        *(f"prefill-{i}" for i in range(num_prefill)),
        *(f"decode-{i}" for i in range(num_decode)),
        "gateway",
    ]
    workers = [p for p in result.placements if p.role != "gateway"]
    for placement in workers:
        assert placement.cpus and placement.cpus <= set(range(num_cpus))
        assert placement.threads == len(placement.cpus)
    # Every CPU is used, and workers share a CPU only when there are fewer CPUs than workers.
    assert set().union(*(p.cpus for p in workers)) == set(range(num_cpus))
    if num_cpus >= num_prefill + num_decode:
        for index, first in enumerate(workers):
            for second in workers[index + 1 :]:
                assert not first.cpus & second.cpus, (first, second)


def test_spread_deals_single_cpus_in_turn_when_short() -> None:
    assert spread([4, 5], 3) == [frozenset({4}), frozenset({5}), frozenset({4})]
    assert spread([0, 1, 2, 3, 4], 2) == [frozenset({0, 1, 2}), frozenset({3, 4})]


def test_plan_uses_the_cpus_given_not_zero_based() -> None:
    assert layout(plan_cpus({2, 3, 6, 7}, CpuRequest())) == {
        "prefill-0": ("2-3", 2),
        "decode-0": ("6-7", 2),
        "gateway": ("2-3", 1),
    }


# ---------------------------------------------------------------------- overrides


def test_cpu_overrides() -> None:
    assert plan(4, cpus_prefill="0", cpus_decode="1-3", cpus_gateway="3") == {
        "prefill-0": ("0", 1),
        "decode-0": ("1-3", 3),
        "gateway": ("3", 1),
    }
    # One pool given: the other takes the rest, or everything when nothing is left.
    assert plan(4, cpus_prefill="3")["decode-0"] == ("0-2", 3)
    assert plan(4, cpus_decode="0,2")["prefill-0"] == ("1,3", 2)
    assert plan(2, cpus_prefill="0-1")["decode-0"] == ("0-1", 2)
    # Colocated: the union of the two pools.
    assert plan(8, colocated=True, cpus_prefill="0-1", cpus_decode="4")["colocated-0"] == (
        "0-1,4",
        3,
    )


def test_thread_overrides() -> None:
    assert plan(4, num_decode=2, threads_prefill=4, threads_decode=1, threads_gateway=2) == {
        "prefill-0": ("0", 4),
        "decode-0": ("1-2", 1),
        "decode-1": ("3", 1),
        "gateway": ("0", 2),
    }
    assert plan(4, colocated=True, threads_colocated=3)["colocated-0"] == ("0-3", 3)


@pytest.mark.parametrize(
    ("request_fields", "message"),
    [
        ({"cpus_prefill": "0-x"}, "--cpus-prefill '0-x': "),
        ({"cpus_decode": "7"}, "--cpus-decode '7': CPU 7 is not available to this process "),
        ({"cpus_gateway": "2-9"}, "--cpus-gateway '2-9': CPU 4-9 is not available"),
        ({"threads_decode": 0}, "--threads-decode must be at least 1"),
        ({"num_prefill": 0}, "--prefill and --decode must be at least 1"),
    ],
)
def test_bad_overrides_are_one_line_errors(request_fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as error:
        plan(4, **request_fields)
    assert str(error.value).startswith(message), str(error.value)
    assert "\n" not in str(error.value)


# ---------------------------------------------------------------------- processes


def test_placement_flags_and_environment() -> None:
    placement = plan_cpus(range(4), CpuRequest()).placement("decode-0", "decode")
    assert placement.serve_args() == ("--cpus", "2-3", "--threads", "2")
    assert placement.env() == {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}


def test_a_worker_added_later_takes_its_roles_slices_in_turn() -> None:
    result = plan_cpus(range(16), CpuRequest(num_prefill=2, num_decode=2))
    assert result.placement("decode-2", "decode", ordinal=2).cpu_list == "8-11"
    assert result.placement("decode-3", "decode", ordinal=3).cpu_list == "12-15"
    # A role the plan has no worker of runs on all of its CPUs.
    colocated = plan_cpus(range(2), CpuRequest(colocated=True))
    assert colocated.placement("decode-0", "decode").cpu_list == "0-1"


def test_describe_has_one_line_per_process() -> None:
    lines = plan_cpus(range(2), CpuRequest()).describe()
    assert [line.split() for line in lines] == [
        ["prefill-0", "CPUs", "0", "1", "thread"],
        ["decode-0", "CPUs", "1", "1", "thread"],
        ["gateway", "CPUs", "0", "1", "thread"],
    ]


# ---------------------------------------------------------------------- nori serve's flags


def test_binding_from_flags() -> None:
    usable = os.sched_getaffinity(0)
    first = min(usable)
    assert CpuBinding.from_flags(None, None) == CpuBinding(None, None)
    assert CpuBinding.from_flags(None, 3) == CpuBinding(None, 3)
    assert CpuBinding.from_flags(str(first), None) == CpuBinding(frozenset({first}), 1)
    assert CpuBinding.from_flags(str(first), None, default_threads=1).threads == 1
    assert CpuBinding.from_flags(format_cpu_list(usable), None).threads == len(usable)
    assert CpuBinding.from_flags(str(first), 4).threads == 4


@pytest.mark.parametrize(
    ("cpus", "threads", "message"),
    [
        ("x", None, "--cpus 'x': "),
        ("100000", None, "--cpus '100000': CPU 100000 is not available to this process"),
        (None, 0, "--threads must be at least 1"),
    ],
)
def test_bad_binding_flags(cpus: str | None, threads: int | None, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{message}"):
        CpuBinding.from_flags(cpus, threads)
