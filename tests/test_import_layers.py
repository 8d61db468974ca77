"""The import contracts of pyproject.toml's [tool.importlinter], checked by import-linter.

Packages form layers that only import downwards (cli at the top, the leaf modules such as
nori.settings at the bottom), so no two packages import each other, even through a third; and
the gateway and the batch runner never reach torch. A broken contract fails this test with
import-linter's report: the chain of imports that breaks it.

import-linter finds the package with `importlib`, then reads its folder. The editable install
maps `nori` onto shared/ and the services/ packages through an import hook, which a folder walk
does not see, so the contracts run over a source tree of symlinks (scripts/source_tree.py) with
one `nori/` folder holding every package.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_LINT = "from importlinter.cli import lint_imports_command; lint_imports_command()"


def test_the_import_contracts_hold(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "source_tree.py"), str(tmp_path)],
        check=True,
        capture_output=True,
        timeout=60,
    )
    # COLUMNS: report lines as they are, not wrapped at 80 characters.
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "COLUMNS": "200"}
    result = subprocess.run(
        [sys.executable, "-c", _LINT, "--no-cache", "--no-logo", str(ROOT / "pyproject.toml")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    # A broken contract's report, or a layer import-linter did not find in the package.
    assert result.returncode == 0, result.stdout + result.stderr
