"""The gateway does no tensor math, so its process must not pay for loading PyTorch (seconds of
start-up and hundreds of MB). The process-level check on a live gateway is in
tests/cluster/test_cluster_e2e.py; this one names the module that pulled torch in."""

from __future__ import annotations

import subprocess
import sys

# Fails with the import chain when any module of the gateway's path imports torch.
_PROBE = """
import sys, traceback

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            traceback.print_stack()
            raise ImportError("the gateway imported torch")

sys.meta_path.insert(0, NoTorch())
from nori.cli.main import build_parser

build_parser().parse_args(["serve", "gateway", "--model", "demo"])
import nori.cli.serve
import nori.gateway.app
import nori.gateway.cluster
import nori.gateway.server
import nori.gateway.endpoints
import nori.gateway.request_flow
assert "torch" not in sys.modules
print("torch-free")
"""


def test_the_gateway_imports_no_torch() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and "torch-free" in result.stdout, result.stderr[-4000:]
