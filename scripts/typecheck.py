"""Runs mypy over the `nori` namespace.

The package maps folders of the fixed layout (shared/, services/*) onto one import name, which
mypy cannot follow on its own; so this builds a tree of symlinks shaped like the installed
package and checks that.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def build_shadow_tree(target: Path) -> Path:
    """Lays out `target/nori/...` as symlinks following pyproject's package-dir mapping."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package_dir: dict[str, str] = config["tool"]["setuptools"]["package-dir"]
    shadow = target / "nori"
    if target.exists():
        subprocess.run(["rm", "-rf", str(target)], check=True)
    shadow.mkdir(parents=True)
    base = ROOT / package_dir["nori"]
    for child in base.iterdir():
        if child.name != "__pycache__":
            (shadow / child.name).symlink_to(child)
    for name, folder in package_dir.items():
        if name != "nori":
            link = target / Path(*name.split("."))
            link.symlink_to(ROOT / folder)
    return shadow


def main() -> int:
    shadow = build_shadow_tree(ROOT / ".typecheck")
    command = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")]
    command += ["-p", "nori"]
    result = subprocess.run(command, cwd=shadow.parent)
    return result.returncode


if __name__ == "__main__":
    raise SystemExit(main())
