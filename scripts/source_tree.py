"""Lays out the `nori` package from source as a tree of symlinks, without installing it.

pyproject.toml maps folders of the fixed layout (shared/, services/*) onto one import name. Tools
that cannot follow that mapping (mypy, a GPU machine with no package registry) get a folder with
`nori/` shaped like the installed package: put the folder on PYTHONPATH or mypy's path.

Usage: python scripts/source_tree.py TARGET_DIR
"""

from __future__ import annotations

import shutil
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def build_source_tree(target: Path) -> Path:
    """Creates `target/nori` (replacing what was there) and returns it."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package_dir: dict[str, str] = config["tool"]["setuptools"]["package-dir"]
    if target.exists():
        shutil.rmtree(target)
    package = target / "nori"
    package.mkdir(parents=True)
    for child in (ROOT / package_dir["nori"]).iterdir():
        if child.name != "__pycache__":
            (package / child.name).symlink_to(child)
    for name, folder in package_dir.items():
        if name != "nori":
            (target / Path(*name.split("."))).symlink_to(ROOT / folder)
    return package


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    print(build_source_tree(Path(sys.argv[1]).resolve()).parent)
