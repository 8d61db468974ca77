"""Runs mypy over the `nori` namespace, laid out from source by scripts/source_tree.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from source_tree import ROOT, build_source_tree


def main() -> int:
    package = build_source_tree(ROOT / ".typecheck")
    command = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")]
    return subprocess.run([*command, "-p", "nori"], cwd=package.parent).returncode


if __name__ == "__main__":
    raise SystemExit(main())
