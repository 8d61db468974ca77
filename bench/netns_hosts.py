"""Several "hosts" on one machine, for cluster tests and cross-host benchmarks: each a network
namespace with one IPv4 address on a private bridge (in a switch namespace of its own), and every
process started in it also in mount, IPC, UTS and PID namespaces of its own (`unshare`), with a
fresh tmpfs on /dev/shm and its own hostname.

Contract: no shared-memory path joins two hosts (own /dev/shm, SysV IPC, abstract sockets, pids);
the file system is shared. The root namespace reaches every host; nothing leaves the bridge. A
host's processes die with the creating process (PR_SET_PDEATHSIG, `unshare --kill-child`).
The layout is drawn in docs/architecture.md#several-hosts-on-one-machine.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from nori.bench.netns import (
    PREFIX,
    creation_lock,
    dies_with_us,
    free_subnet,
    ip,
    kill_namespace,
    sweep_stale,
)

# Inside a host: a fresh /dev/shm, its hostname, then the command itself ("$@").
_HOST_SCRIPT = 'mount -t tmpfs -o mode=1777 tmpfs /dev/shm && hostname "$0" && exec "$@"'


class NamespacesUnavailable(RuntimeError):
    """This machine cannot make hosts (the message says why)."""


def namespaces_unavailable() -> str | None:
    """Why this machine cannot make hosts, or None when it can (root, `ip` and `unshare`, and
    the kernel lets us create a network namespace and run a command in a host's namespaces)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"no `{tool}` on PATH"
    probe = f"{PREFIX}{os.getpid()}x{secrets.token_hex(2)}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    try:
        host = Host("probe", probe, "", "", "", "")
        ran = subprocess.run(host.command(["true"]), capture_output=True, text=True, timeout=30)
        if ran.returncode != 0:
            return f"cannot run a command in a host's namespaces: {ran.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def require_namespaces() -> None:
    """Where the machine cannot make hosts: under pytest, pytest.skip with the reason; else
    NamespacesUnavailable (a benchmark's error)."""
    reason = namespaces_unavailable()
    if reason is None:
        return
    if "pytest" in sys.modules:
        import pytest

        pytest.skip(reason)
    raise NamespacesUnavailable(reason)


@dataclass
class HostProcess:
    """A command running in a host. `launcher` is `ip netns exec ... unshare`, which waits for
    the command and exits with its status; `pid` is the command itself (pid 1 of the host's PID
    namespace, numbered here as the root namespace sees it)."""

    name: str
    launcher: subprocess.Popen[bytes]
    log_path: Path
    pid: int = 0

    def poll(self) -> int | None:
        return self.launcher.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.launcher.wait(timeout)

    def signal(self, signum: int) -> None:
        if self.launcher.poll() is None and self.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM, then SIGKILL after `timeout_s`. As the init of its PID namespace the command
        gets only the signals it handles (Nori's roles and redis-server handle SIGTERM: they
        drain and exit) and SIGKILL; everything else in the namespace dies with it."""
        self.signal(signal.SIGTERM)
        try:
            self.launcher.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.launcher.kill()
            self.launcher.wait(10)

    def log(self, tail: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-tail:]
        except OSError:
            return ""


def _child_pid(launcher: subprocess.Popen[bytes], timeout_s: float = 10.0) -> int:
    """The one child of `launcher` (unshare's forked child), once it exists; 0 when the
    launcher has already exited (a command that ended at once)."""
    deadline = time.monotonic() + timeout_s
    parent = launcher.pid
    path = Path(f"/proc/{parent}/task/{parent}/children")
    while time.monotonic() < deadline and launcher.poll() is None:
        try:
            children = path.read_text().split()
        except OSError:
            children = []
        if children:
            return int(children[0])
        time.sleep(0.01)
    if launcher.poll() is not None:
        return 0
    raise RuntimeError(f"process {parent} started no command within {timeout_s} s")


@dataclass
class Host:
    """One host: its network namespace, its address, and the processes started in it."""

    name: str
    namespace: str
    address: str
    # Its end of the link (in its namespace) and the bridge's port for it (in the switch's).
    device: str
    switch_port: str
    switch: str
    processes: list[HostProcess] = field(default_factory=list)
    torn_down: bool = False

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` as run in this host: its network namespace, fresh mount (private /dev/shm,
        its own /proc), IPC, UTS (its hostname) and PID namespaces."""
        return [
            "ip",
            "netns",
            "exec",
            self.namespace,
            "unshare",
            "--mount",
            "--ipc",
            "--uts",
            "--pid",
            "--fork",
            "--kill-child",
            "--mount-proc",
            "--propagation",
            "private",
            "sh",
            "-c",
            _HOST_SCRIPT,
            self.name,
            *argv,
        ]

    def spawn(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        env: Mapping[str, str] | None = None,
    ) -> HostProcess:
        """Starts `argv` in this host, its output in `log_path`."""
        if self.torn_down:
            raise RuntimeError(f"host {self.name} is torn down")
        with log_path.open("wb") as log:
            launcher = subprocess.Popen(
                dies_with_us(self.command(argv)),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(os.environ if env is None else env),
            )
        process = HostProcess(name, launcher, log_path)
        self.processes.append(process)
        process.pid = _child_pid(launcher)
        return process

    def run(self, argv: Sequence[str], timeout_s: float = 30.0) -> subprocess.CompletedProcess[str]:
        """Runs a short command in this host and waits for it (output captured)."""
        return subprocess.run(self.command(argv), capture_output=True, text=True, timeout=timeout_s)

    # ------------------------------------------------------------------ faults

    def link_down(self) -> None:
        """Pulls the cable at the switch: both ends lose carrier, nothing passes either way,
        and no reset or error reaches anyone (addresses and connections stay as they are)."""
        ip("-n", self.switch, "link", "set", self.switch_port, "down")

    def link_up(self) -> None:
        ip("-n", self.switch, "link", "set", self.switch_port, "up")

    @contextlib.contextmanager
    def link_cut(self) -> Iterator[None]:
        """The link is down inside the block, up again after it, whatever happens."""
        self.link_down()
        try:
            yield
        finally:
            if not self.torn_down:
                self.link_up()

    def cut_link(self, seconds: float) -> None:
        """Cuts the link for `seconds` (blocking)."""
        with self.link_cut():
            time.sleep(seconds)

    def tear_down(self, abrupt: bool = True) -> None:
        """Kills every process of the host and deletes its namespace (and with it its link).
        `abrupt`: the link goes first, so the dying processes' FINs and resets never reach
        the network, as when a machine loses power; else they go out before it vanishes."""
        if self.torn_down:
            return
        if abrupt:
            self.link_down()
        self.torn_down = True
        kill_namespace(self.namespace)
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.launcher.wait(10)


class Hosts:
    """N hosts on a private bridge (`add` each, or pass names); `close` removes all of it.

    Use as a context manager, or call `close` in a `finally`: it kills every process it
    started, deletes every namespace and the root namespace's link, whatever state they are in.
    """

    def __init__(self, names: Sequence[str] = ()) -> None:
        require_namespaces()
        sweep_stale()
        self.tag = f"{PREFIX}{os.getpid()}x{secrets.token_hex(2)}"
        self.switch = f"{self.tag}-sw"
        # The root namespace's end of its link (an interface name: at most 15 characters).
        self.root_device = self.tag
        self.hosts: dict[str, Host] = {}
        self._closed = False
        try:
            with creation_lock():
                self.subnet = free_subnet()
                self._make_switch()
            for name in names:
                self.add(name)
        except BaseException:
            self.close()
            raise

    @property
    def root_address(self) -> str:
        """The root namespace's address on the bridge (where the test process is)."""
        return str(self.subnet.network_address + 1)

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def _make_switch(self) -> None:
        ip("netns", "add", self.switch)
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", self.switch, "link", "set", "br0", "up")
        ip("-n", self.switch, "link", "set", "lo", "up")
        ip("link", "add", self.root_device, "type", "veth", "peer", "name", "root", "netns",
            self.switch)  # fmt: skip
        ip("-n", self.switch, "link", "set", "root", "master", "br0", "up")
        ip("addr", "add", f"{self.root_address}/{self.subnet.prefixlen}", "dev", self.root_device)
        ip("link", "set", self.root_device, "up")

    def add(self, name: str) -> Host:
        """A new host on the bridge: its namespace, `lo` up, eth0 with the next address."""
        if not re.fullmatch(r"[a-z0-9-]{1,20}", name) or name in self.hosts:
            raise ValueError(f"bad or duplicate host name {name!r}")
        index = len(self.hosts)
        address = str(self.subnet.network_address + 2 + index)
        namespace = f"{self.tag}-{name}"
        port = f"p{index}"
        host = Host(name, namespace, address, "eth0", port, self.switch)
        self.hosts[name] = host
        ip("netns", "add", namespace)
        ip("-n", namespace, "link", "set", "lo", "up")
        ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0",
            "netns", namespace)  # fmt: skip
        ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
        ip("-n", namespace, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", "eth0")
        ip("-n", namespace, "link", "set", "eth0", "up")
        return host

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for host in self.hosts.values():
            for process in host.processes:
                process.signal(signal.SIGKILL)
            host.torn_down = True
            kill_namespace(host.namespace)
            for process in host.processes:
                with contextlib.suppress(subprocess.TimeoutExpired, OSError):
                    process.launcher.kill()
                    process.launcher.wait(10)
        kill_namespace(self.switch)  # takes every bridge port and the root's link with it
        # The kernel destroys a namespace's devices in the background: wait for the root's end.
        deadline = time.monotonic() + 10
        while ip("link", "show", self.root_device, check=False).returncode == 0:
            ip("link", "del", self.root_device, check=False)
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)

    def leftovers(self) -> list[str]:
        """Namespaces and devices of this run still present (empty after `close`)."""
        names = ip("netns", "list", check=False).stdout
        links = ip("-o", "link", "show", check=False).stdout
        return sorted({name for name in re.findall(rf"\b{self.tag}[\w-]*", names + links)})

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
