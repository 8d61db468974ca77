"""Several "hosts" on one machine, for cluster tests (tests/cluster/test_cross_host.py) and
cross-host benchmarks (bench/cross_host_transfer.py, bench/cross_host_serving.py): each a network
namespace of its own, with one IPv4 address on a private bridge, and every process started in it
also in mount, IPC, UTS and PID namespaces of its own (`unshare`), with a fresh tmpfs on
/dev/shm and its own hostname.

    root namespace --- veth ---+
                               |   switch namespace: bridge br0 (no address, no route out)
    host 0 (eth0: .2) - veth --+
    host 1 (eth0: .3) - veth --+
    ...

The subnet is 10.213.X.0/24 with X picked per run among those the root namespace does not
route yet (`.1` is the root namespace's end, so that the test process itself reaches the hosts;
no host has a default route, so nothing they send leaves these namespaces). The bridge lives in a
namespace of its own, not the root's: the root's firewall (Docker's FORWARD rules, with
br_netfilter loaded) never sees the hosts' traffic.

No shared-memory path joins two hosts: each has its own /dev/shm (POSIX shared memory), SysV IPC
namespace, abstract Unix sockets (they belong to the network namespace), /proc and pids (a
process_vm_readv by another host's pid names another process, or none). The file system is
otherwise shared (the model, the virtualenv, the logs).

Every name carries the creating process's pid and a random tag (`nh<pid>x<tag>-...`), so two
runs never collide, and a run killed before its teardown is swept by the next one
(`sweep_stale`). Every process is started with PR_SET_PDEATHSIG (`setpriv --pdeathsig`) and
`unshare --kill-child`: if the test process dies, its hosts' processes die with it (the PID
namespace's init first, then, by the kernel, everything else in it).
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
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

# The private range the hosts' subnets are taken from: 10.213.X.0/24.
SUBNET_BASE = ipaddress.IPv4Network("10.213.0.0/16")
# Every namespace and root-side device of this module starts with it.
PREFIX = "nh"
_NAME = re.compile(rf"^{PREFIX}(\d+)x[0-9a-f]+(-.*)?$")
# Serializes picking a subnet and creating its devices between concurrent runs.
_LOCK_PATH = Path("/run" if os.path.isdir("/run") else "/tmp") / "nori-netns-hosts.lock"
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


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def _netns_pids(namespace: str) -> list[int]:
    done = _ip("netns", "pids", namespace, check=False)
    return [int(pid) for pid in done.stdout.split()] if done.returncode == 0 else []


def _kill_namespace(namespace: str, timeout_s: float = 10.0) -> None:
    """SIGKILLs every process in the network namespace until none is left, then deletes it."""
    deadline = time.monotonic() + timeout_s
    while pids := _netns_pids(namespace):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    _ip("netns", "del", namespace, check=False)


def _alive(pid: int) -> bool:
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
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    for line in listed:
        name = line.split(" ")[0]
        found = _NAME.match(name)
        if found and not _alive(int(found.group(1))):
            _kill_namespace(name)
            swept.append(name)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        device = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        found = _NAME.match(device)
        if found and not _alive(int(found.group(1))):
            _ip("link", "del", device, check=False)
            swept.append(device)
    return swept


def _dies_with_us(argv: list[str]) -> list[str]:
    """`argv` with PR_SET_PDEATHSIG (SIGKILL) set first, by `setpriv`: `ip netns exec` and then
    unshare exec in the same process, which keeps it. Not a preexec_fn: forking this process
    (gRPC's threads and fork handlers live in it) to run Python before the exec aborted the
    child now and then (gRPC's poller: "epoll_wait error: Bad file descriptor")."""
    if shutil.which("setpriv") is None:
        return argv
    return ["setpriv", "--pdeathsig", "KILL", *argv]


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
                _dies_with_us(self.command(argv)),
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
        _ip("-n", self.switch, "link", "set", self.switch_port, "down")

    def link_up(self) -> None:
        _ip("-n", self.switch, "link", "set", self.switch_port, "up")

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
        _kill_namespace(self.namespace)
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
            with _creation_lock():
                self.subnet = _free_subnet()
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
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        _ip("-n", self.switch, "link", "set", "lo", "up")
        _ip("link", "add", self.root_device, "type", "veth", "peer", "name", "root", "netns",
            self.switch)  # fmt: skip
        _ip("-n", self.switch, "link", "set", "root", "master", "br0", "up")
        _ip("addr", "add", f"{self.root_address}/{self.subnet.prefixlen}", "dev", self.root_device)
        _ip("link", "set", self.root_device, "up")

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
        _ip("netns", "add", namespace)
        _ip("-n", namespace, "link", "set", "lo", "up")
        _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0",
            "netns", namespace)  # fmt: skip
        _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
        _ip("-n", namespace, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", "eth0")
        _ip("-n", namespace, "link", "set", "eth0", "up")
        return host

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for host in self.hosts.values():
            for process in host.processes:
                process.signal(signal.SIGKILL)
            host.torn_down = True
            _kill_namespace(host.namespace)
            for process in host.processes:
                with contextlib.suppress(subprocess.TimeoutExpired, OSError):
                    process.launcher.kill()
                    process.launcher.wait(10)
        _kill_namespace(self.switch)  # takes every bridge port and the root's link with it
        # The kernel destroys a namespace's devices in the background: wait for the root's end.
        deadline = time.monotonic() + 10
        while _ip("link", "show", self.root_device, check=False).returncode == 0:
            _ip("link", "del", self.root_device, check=False)
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)

    def leftovers(self) -> list[str]:
        """Namespaces and devices of this run still present (empty after `close`)."""
        names = _ip("netns", "list", check=False).stdout
        links = _ip("-o", "link", "show", check=False).stdout
        return sorted({name for name in re.findall(rf"\b{self.tag}[\w-]*", names + links)})

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def _creation_lock() -> Iterator[None]:
    with _LOCK_PATH.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 of SUBNET_BASE that no route of the root namespace (any table) overlaps."""
    taken: list[ipaddress.IPv4Network] = []
    for line in _ip("-4", "route", "show", "table", "all", check=False).stdout.splitlines():
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
