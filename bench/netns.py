"""Network-namespace plumbing for bench/netns_hosts.py: `ip` calls, the names every namespace
and device carries (`nh<pid>x<tag>-...`), a free private /24, the creation lock, and the sweep
of namespaces left by a run killed before its teardown.

Invariant: every namespace and root-side device created through this module matches NAME, and
its pid names the process that created it; `sweep_stale` removes only those whose process is gone.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

# The private range the hosts' subnets are taken from: 10.213.X.0/24.
SUBNET_BASE = ipaddress.IPv4Network("10.213.0.0/16")
# Every namespace and root-side device of this module starts with it.
PREFIX = "nh"
NAME = re.compile(rf"^{PREFIX}(\d+)x[0-9a-f]+(-.*)?$")
# Serializes picking a subnet and creating its devices between concurrent runs.
LOCK_PATH = Path("/run" if os.path.isdir("/run") else "/tmp") / "nori-netns-hosts.lock"


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def netns_pids(namespace: str) -> list[int]:
    done = ip("netns", "pids", namespace, check=False)
    return [int(pid) for pid in done.stdout.split()] if done.returncode == 0 else []


def kill_namespace(namespace: str, timeout_s: float = 10.0) -> None:
    """SIGKILLs every process in the network namespace until none is left, then deletes it."""
    deadline = time.monotonic() + timeout_s
    while pids := netns_pids(namespace):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    ip("netns", "del", namespace, check=False)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Removes the namespaces and root-side devices of runs whose process is gone (killed
    before their teardown); returns their names."""
    swept = []
    listed = ip("netns", "list", check=False).stdout.split("\n")
    for line in listed:
        name = line.split(" ")[0]
        found = NAME.match(name)
        if found and not alive(int(found.group(1))):
            kill_namespace(name)
            swept.append(name)
    for line in ip("-o", "link", "show", check=False).stdout.splitlines():
        device = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        found = NAME.match(device)
        if found and not alive(int(found.group(1))):
            ip("link", "del", device, check=False)
            swept.append(device)
    return swept


def dies_with_us(argv: list[str]) -> list[str]:
    """`argv` with PR_SET_PDEATHSIG (SIGKILL) set first, by `setpriv`: `ip netns exec` and then
    unshare exec in the same process, which keeps it. Not a preexec_fn: forking this process
    (gRPC's threads and fork handlers live in it) to run Python before the exec aborted the
    child now and then (gRPC's poller: "epoll_wait error: Bad file descriptor")."""
    if shutil.which("setpriv") is None:
        return argv
    return ["setpriv", "--pdeathsig", "KILL", *argv]


@contextlib.contextmanager
def creation_lock() -> Iterator[None]:
    with LOCK_PATH.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def free_subnet() -> ipaddress.IPv4Network:
    """A /24 of SUBNET_BASE that no route of the root namespace (any table) overlaps."""
    taken: list[ipaddress.IPv4Network] = []
    for line in ip("-4", "route", "show", "table", "all", check=False).stdout.splitlines():
        words = line.split()
        if words and words[0] in ("local", "broadcast", "unreachable", "blackhole", "prohibit"):
            words = words[1:]
        if words and words[0] != "default":
            with contextlib.suppress(ValueError):
                taken.append(ipaddress.IPv4Network(words[0], strict=False))
    candidates = list(SUBNET_BASE.subnets(new_prefix=24))
    start = secrets.randbelow(len(candidates))
    for subnet in candidates[start:] + candidates[:start]:
        if not any(subnet.overlaps(other) for other in taken):
            return subnet
    raise RuntimeError(f"no free /24 left in {SUBNET_BASE}")
