"""The README's layout section names every file of the tree, and every file it names exists.

The layout block is a tree: a top folder at column 0, a sub-folder or file at column 2, and
descriptions further right. Each file name in a folder's lines belongs to that folder.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILE = re.compile(r"\b[\w-]+\.(?:py|sh|yaml|yml|json|cpp|h)\b")
FOLDER = re.compile(r"^( {0,2})([\w-]+)/(?:\s|$)")
# Folders whose every file the layout must name (tests/ is described as a whole).
LISTED = ("cluster", "router", "workers", "kernels", "lang", "deploy", "load_tests")


def layout_block() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    return section.split("```\n", 2)[1].splitlines()


def named_files() -> set[str]:
    """Repository paths of the files the layout block names."""
    top = sub = ""
    names: set[str] = set()
    for line in layout_block():
        m = FOLDER.match(line)
        if m and not m.group(1):
            top, sub = m.group(2), ""
        elif m:
            sub = m.group(2)
        elif re.match(r"^  \S", line):  # a file directly in the top folder ends the sub-folder
            sub = ""
        folder = f"{top}/{sub}" if sub else top
        for name in FILE.findall(line):
            if name.startswith(("radixserve.", "load_tests.")):
                continue
            names.add(f"{folder}/{name}")
    return names


def tree_files() -> set[str]:
    files = set()
    for top in LISTED:
        for path in (ROOT / top).rglob("*"):
            rel = path.relative_to(ROOT)
            if not path.is_file() or path.name == "__init__.py" or "__pycache__" in rel.parts:
                continue
            if top == "deploy" and rel.parts[1] == "grafana":  # described as a folder
                continue
            if path.suffix not in {".py", ".sh", ".yaml", ".yml", ".json", ".cpp", ".h"}:
                continue
            files.add(rel.as_posix())
    return files


def test_the_layout_names_every_file_of_the_tree():
    missing = sorted(tree_files() - named_files())
    assert not missing, f"files the README's layout section does not name: {missing}"


def test_every_file_the_layout_names_exists():
    absent = sorted(p for p in named_files() if not (ROOT / p).is_file())
    assert not absent, f"files the README's layout section names but the tree lacks: {absent}"
