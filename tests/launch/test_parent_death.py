"""A role started with the launcher's name in its environment ends when the launcher is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

ROLE = "from nori.parent_death import die_with_parent; die_with_parent(); " \
    "import time; time.sleep(60)"  # fmt: skip
LAUNCHER = textwrap.dedent(f"""
    import os, subprocess, sys, time
    from nori.parent_death import launcher_env
    role = subprocess.Popen([sys.executable, "-c", {ROLE!r}], env={{**os.environ, **launcher_env()}})
    print(role.pid, flush=True)
    time.sleep(60)
""")


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie (its parent gone, not yet reaped by init) counts as gone.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split()[2] == "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_role_ends_when_its_launcher_is_killed() -> None:
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True)
    assert launcher.stdout is not None
    role = int(launcher.stdout.readline())
    time.sleep(1.0)  # the role has started and asked for the signal
    assert not _gone(role)
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + 10
    while not _gone(role) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(role)
