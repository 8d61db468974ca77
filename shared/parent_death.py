"""Roles that `nori up` (or a test) starts end when their launcher dies, even by SIGKILL.

The launcher names itself in NORI_DIE_WITH_PARENT; first thing at start, the role asks Linux for
SIGTERM when its parent goes (PR_SET_PDEATHSIG; never in a `preexec_fn`: gRPC deadlocks)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

ENV = "NORI_DIE_WITH_PARENT"
_PR_SET_PDEATHSIG = 1


def launcher_env() -> dict[str, str]:
    """What the launcher puts in each role's environment."""
    return {ENV: str(os.getpid())}


def die_with_parent() -> None:
    """In a role at start: SIGTERM when the launcher dies; exit now if it already has."""
    launcher = os.environ.pop(ENV, None)  # not for the role's own children
    if launcher is not None:
        exit_with_parent(int(launcher), signal.SIGTERM)


def exit_with_parent(parent_pid: int, signum: int) -> None:
    """Asks Linux for `signum` when this process's parent dies; exits now if `parent_pid` (the
    parent it was started by) has already gone."""
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signum)
    if os.getppid() != parent_pid:  # it died before the request took effect
        raise SystemExit(f"nori: the launcher (pid {parent_pid}) is gone; exiting")
