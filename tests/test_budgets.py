"""The product's size budgets (docs/architecture.md#budgets).

Product code is the Python under `services/` and `shared/`, generated gRPC stubs (`*_pb2*`)
left out. A request's path is what `scripts/request_path.py` measures on a running cluster:
the files one disaggregated `/v1/completions` passes through, without the model's forward.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_FILE_LINES = 400
MAX_PRODUCT_LINES = 30_000
# The request path's ceiling: it may shrink, never grow (lower these as it does) except by what
# an issue asks for; docs/benchmarks.md records each change. Measured: 48-49 files, 12,362-12,630.
MAX_PATH_FILES = 49
MAX_PATH_LINES = 12_650


def product_files() -> dict[str, int]:
    files = sorted([*ROOT.glob("services/**/*.py"), *ROOT.glob("shared/**/*.py")])
    return {
        str(path.relative_to(ROOT)): len(path.read_text().splitlines())
        for path in files
        if "_pb2" not in path.name
    }


def test_no_product_file_is_over_the_line_limit() -> None:
    over = {name: lines for name, lines in product_files().items() if lines > MAX_FILE_LINES}
    assert not over, f"product files over {MAX_FILE_LINES} lines: {over}"


def test_product_python_is_within_its_budget() -> None:
    total = sum(product_files().values())
    assert 0 < total <= MAX_PRODUCT_LINES, f"{total} lines of product Python"


def test_a_requests_path_is_within_its_budget(tmp_path: Path) -> None:
    result_file = tmp_path / "path.json"
    process = subprocess.run(
        [sys.executable, str(ROOT / "scripts/request_path.py"), "--json", str(result_file)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert process.returncode == 0, process.stdout + process.stderr
    result = json.loads(result_file.read_text())
    files = [row["file"] for row in result["files"]]
    # The measurement sees the request: the gateway, both workers and the engine are on it.
    for expected in (
        "services/gateway/request_flow.py",
        "services/prefill/servicer.py",
        "services/decode/servicer.py",
        "shared/engine/engine.py",
    ):
        assert expected in files, process.stdout
    assert result["serving_files"] <= MAX_PATH_FILES, process.stdout
    assert result["serving_lines"] <= MAX_PATH_LINES, process.stdout


@pytest.mark.parametrize(
    "doc",
    [
        "README.md",
        "docs/architecture.md",
        "docs/operations.md",
        "docs/serving.md",
        "docs/models.md",
    ],
)
def test_the_docs_name_only_files_that_exist(doc: str) -> None:
    text = (ROOT / doc).read_text()
    named = set(
        re.findall(r"`((?:services|shared|bench|scripts|deploy)/[\w/.-]+\.(?:py|sh))`", text)
    )
    missing = sorted(name for name in named if not (ROOT / name).exists())
    assert not missing, f"{doc} names files that do not exist: {missing}"
