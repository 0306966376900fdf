"""The installed package names over this checkout, without installing it: under ROOT, one link per
entry of pyproject.toml's [tool.setuptools.package-dir] (ROOT/radixserve/cluster -> cluster, ...).
Linters that walk packages (mypy, import-linter) and gpu_check.sh's runs on a bare host put ROOT
on their path. Prints the linked package names, one per line.

    python load_tests/package_links.py build/lint
"""

from __future__ import annotations

import os
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def package_dirs() -> dict[str, str]:
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]["package-dir"]


def link(root: Path) -> list[str]:
    names = []
    for name, folder in sorted(package_dirs().items()):
        at = root.joinpath(*name.split("."))
        at.parent.mkdir(parents=True, exist_ok=True)
        target = os.path.relpath(REPO / folder, at.parent.resolve())
        if at.is_symlink() and os.readlink(at) != target:
            at.unlink()
        elif at.exists() and not at.is_symlink():
            sys.exit(f"{at} is not a link: remove it")
        if not at.is_symlink():
            at.symlink_to(target, target_is_directory=True)
        names.append(name)
    return names


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        sys.exit(f"usage: {Path(__file__).name} ROOT")
    root = Path(argv[0])
    if not root.is_absolute():
        root = Path.cwd() / root
    print("\n".join(link(root)))


if __name__ == "__main__":
    main(sys.argv[1:])
