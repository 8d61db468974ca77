"""One process of a local cluster: started with its output in a log file (and told to die with
its launcher), restarted with backoff when it exits unexpectedly."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from nori.parent_death import launcher_env
from nori.settings import Role

# Restart backoff after an unexpected exit: 1, 2, 4, ... s up to this; reset once it ran this long.
MAX_RESTART_DELAY_S = 30.0
STABLE_AFTER_S = 60.0


def start_process(
    argv: list[str], env: dict[str, str], log_path: Path, mode: str
) -> subprocess.Popen[bytes]:
    """Runs `argv` with its output in `log_path` ("wb": new; "ab": a restart, appended)."""
    with log_path.open(mode) as log:
        if mode == "ab":
            log.write(f"--- restarted at {time.strftime('%Y-%m-%d %H:%M:%S')} ---\n".encode())
            log.flush()
        return subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env={**env, **launcher_env()}
        )


@dataclass
class RoleProcess:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    # A worker's gRPC address, from the registry (it binds a port of its own); "" for the gateway.
    grpc_address: str = ""
    role: Role | None = None
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict, repr=False)
    started_at: float = field(default_factory=time.monotonic)
    restarts: int = 0
    # When a restart is due (time.monotonic()); None: running, or left for good.
    restart_at: float | None = None
    # Exited with status 0 after draining (a SIGTERM sent to it alone): not restarted.
    left: bool = False

    def log_tail(self, num_chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""

    def supervise(self, now: float) -> str | None:
        """Restarts the process if it exited unexpectedly (not status 0 after draining) and its
        backoff is over; what happened, in a line, if anything did."""
        if self.left:
            return None
        if self.restart_at is not None:
            if now < self.restart_at:
                return None
            self.restart_at = None
            self.restarts += 1
            self.started_at = now
            self.process = start_process(self.argv, self.env, self.log_path, "ab")
            return f"{self.name} restarted (restart {self.restarts})"
        code = self.process.poll()
        if code is None:
            return None
        if code == 0 and self.role != "gateway":
            self.left = True
            return f"{self.name} left the cluster (drained, exit status 0)"
        if now - self.started_at > STABLE_AFTER_S:
            self.restarts = 0
        delay = min(MAX_RESTART_DELAY_S, 2.0**self.restarts)
        self.restart_at = now + delay
        return (
            f"{self.name} exited with status {code}; restarting in {delay:g} s "
            f"(log: {self.log_path})"
        )
