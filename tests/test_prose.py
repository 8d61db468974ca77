"""Source prose states contracts; figures live in docs/ and results/.

Over services/ and shared/ (product Python, no generated *_pb2* modules):
- a module, class or function docstring runs to at most `MAX_DOCSTRING_LINES` lines and links
  docs/benchmarks.md at most once, to a heading that exists;
- no docstring or comment quotes a measurement (`MEASUREMENT` below) or an issue.

A duration given as a setting (a timeout, a poll interval, a backoff: "a try every 0.25 s") is a
parameter, not a measurement, and passes; a duration compared with another ("1.0 against 2.9 ms"),
or what something took or cost, is a measurement. Throughputs, microseconds, speed-ups and
percentages are always measurements here.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

MAX_DOCSTRING_LINES = 12


_NUMBER = r"\d[\d.,]*"
MEASUREMENT = re.compile(
    "|".join(
        [
            # throughputs
            rf"{_NUMBER}\s*(?:[KMGT]i?B|[KMG]b)/s\b",
            rf"{_NUMBER}\s*(?:tok|tokens|req|requests|it)/s\b",
            # durations below a millisecond are timings, never settings
            rf"{_NUMBER}\s*(?:us|µs|ns)\b",
            # speed-ups and ratios: 1.3x, 2-7x, 5×
            r"\b\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?[x×](?!\w)",
            # percentages
            rf"{_NUMBER}\s*%",
            # one figure against another: "331 against 339", "0.7 -> 3.4 GB/s", "63 to 5"
            rf"{_NUMBER}\s*(?:ms|s|us|µs|GB/s|MB/s|%)?\s+(?:vs\.?|versus|against|instead of|->|→)"
            rf"\s+~?{_NUMBER}",
            rf"\bfrom\s+~?{_NUMBER}\s*(?:ms|s|%)?\s+to\s+~?{_NUMBER}",
            # what something took or cost
            rf"\b(?:took|takes|taking|cost|costs|costing|ran|runs at)\s+(?:about\s+|~)?"
            rf"{_NUMBER}\s*(?:ms|s|seconds|us|µs)\b",
            r"\(measured\b|\bmeasured:",
            # the hosts benchmarks ran on
            r"\b(?:EPYC|Xeon)\b",
            # issue histories and result folders
            r"\bissues?\s*#?\d+",
            r"\(#\d+\)",
            r"(?<![\w/>])results/(?!<)",
        ]
    ),
    re.IGNORECASE,
)


def _product_files() -> list[Path]:
    return sorted(
        path
        for folder in ("services", "shared")
        for path in (ROOT / folder).rglob("*.py")
        if "_pb2" not in path.name
    )


def _docstrings(tree: ast.Module) -> list[tuple[str, ast.Expr]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                found.append((getattr(node, "name", "module"), first))
    return found


def _prose_lines(source: str, tree: ast.Module) -> set[int]:
    lines = set()
    for _, expr in _docstrings(tree):
        lines.update(range(expr.lineno, (expr.end_lineno or expr.lineno) + 1))
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            lines.add(token.start[0])
    return lines


def _benchmark_anchors() -> set[str]:
    anchors = set()
    for line in (ROOT / "docs" / "benchmarks.md").read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


FILES = _product_files()


@pytest.mark.parametrize("path", FILES, ids=lambda path: path.relative_to(ROOT).as_posix())
def test_docstrings_state_contracts(path: Path) -> None:
    source = path.read_text()
    tree = ast.parse(source)
    anchors = _benchmark_anchors()
    problems = []
    for name, expr in _docstrings(tree):
        length = (expr.end_lineno or expr.lineno) - expr.lineno + 1
        if length > MAX_DOCSTRING_LINES:
            problems.append(f"line {expr.lineno}: {name}'s docstring runs to {length} lines")
        text = str(expr.value.value)  # type: ignore[attr-defined]
        links = re.findall(r"docs/benchmarks\.md(#[\w-]+)?", text)
        if len(links) > 1:
            problems.append(f"line {expr.lineno}: {name}'s docstring links docs/ more than once")
        for anchor in links:
            if anchor and anchor[1:] not in anchors:
                problems.append(f"line {expr.lineno}: no heading docs/benchmarks.md{anchor}")
    lines = source.splitlines()
    for number in sorted(_prose_lines(source, tree)):
        match = MEASUREMENT.search(lines[number - 1])
        if match:
            problems.append(f"line {number} quotes a measurement ({match.group(0)!r})")
    assert not problems, "\n".join(problems)
