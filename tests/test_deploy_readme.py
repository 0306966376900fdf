"""The README's Deployment section promises that every command in it is run by deploy/e2e.sh or by
a test. Each place that runs one carries a `README: <command>` comment next to it (the command as
the README writes it; the place may run it on a copy with its own ports); this checks that every
command has one, and that no such comment names a command the README dropped. No Ray."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"#\s*README:\s*(.+?)\s*$")


def readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Deployment\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    return [
        line.strip() for b in blocks for line in b.splitlines() if line.strip() and not line.startswith("#")
    ]


def markers() -> dict[str, list[str]]:
    """Command -> the files whose comments say they run it."""
    found: dict[str, list[str]] = {}
    for path in [REPO / "deploy" / "e2e.sh", *sorted((REPO / "tests").glob("*.py"))]:
        if path.name == Path(__file__).name:
            continue
        for line in path.read_text().splitlines():
            if m := MARKER.search(line):
                found.setdefault(m.group(1), []).append(path.name)
    return found


def test_the_deployment_section_has_commands():
    commands = readme_commands()
    assert "ray up -y deploy/cluster.yaml" in commands and "ray down -y deploy/cluster.yaml" in commands
    assert len(commands) == len(set(commands))


def test_every_readme_command_is_run_by_e2e_or_a_test():
    found = markers()
    assert [c for c in readme_commands() if c not in found] == []


def test_no_marker_names_a_command_the_readme_dropped():
    assert sorted(set(markers()) - set(readme_commands())) == []
