"""results/ holds the raw data the README and docs/ quote, and no more than `MAX_RESULTS_BYTES`.

Every `results/PATH` named in README.md or docs/*.md exists (a glob or a `{a,b}` alternative
matches at least one file or folder). Data that left the tree is named `COMMIT:results/PATH`
and must be in that commit, where the commit is in this clone (a shallow one may lack it).
"""

from __future__ import annotations

import itertools
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

MAX_RESULTS_BYTES = 2 * 1024 * 1024

DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# A path under results/, optionally after the commit that holds it; `<...>` is a template.
_REFERENCE = re.compile(r"(?:\b([0-9a-f]{7,40}):)?(?<![\w/])(results/[\w./*{},-]*)")


def _references() -> list[tuple[str, str | None, str]]:
    found = []
    for document in DOCUMENTS:
        # An image link from docs/ names results/ relative to docs/.
        text = document.read_text().replace("](../results/", "](results/")
        for match in _REFERENCE.finditer(text):
            commit, path = match.group(1), match.group(2).rstrip(".,")
            end = match.end(2)
            if path != "results/" and match.string[end : end + 1] != "<":
                found.append((document.name, commit, path))
    return found


def _alternatives(path: str) -> list[str]:
    """`a{b,c}d` -> [abd, acd]."""
    parts = re.split(r"\{([^}]*)\}", path)
    choices = [part.split(",") if index % 2 else [part] for index, part in enumerate(parts)]
    return ["".join(pieces) for pieces in itertools.product(*choices)]


def _in_commit(commit: str, path: str) -> bool | None:
    """Whether `path` (no glob) is in `commit`; None when this clone lacks the commit."""
    known = subprocess.run(
        ["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=ROOT, capture_output=True
    )
    if known.returncode != 0:
        return None
    found = subprocess.run(
        ["git", "cat-file", "-e", f"{commit}:{path.rstrip('/')}"], cwd=ROOT, capture_output=True
    )
    return found.returncode == 0


def test_every_results_path_the_docs_name_exists() -> None:
    missing = []
    for document, commit, path in _references():
        for alternative in _alternatives(path):
            if commit is None:
                if not list(ROOT.glob(alternative.rstrip("/"))):
                    missing.append(f"{document}: {alternative}")
            elif "*" not in alternative and _in_commit(commit, alternative) is False:
                missing.append(f"{document}: {commit}:{alternative}")
    assert not missing, "\n".join(missing)


def test_results_stay_small() -> None:
    files = [path for path in (ROOT / "results").rglob("*") if path.is_file()]
    total = sum(path.stat().st_size for path in files)
    assert total <= MAX_RESULTS_BYTES, f"results/ holds {total} bytes in {len(files)} files"


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: path.name)
def test_documents_exist(document: Path) -> None:
    assert document.is_file()
