"""The README's test command (`make test`): the whole suite as two pytest processes side by side.

The modules marked `ray` start a Ray instance each (a live Serve app, a multi-node cluster); they
run one after another in one process, since two Ray instances at once would share the two cores
and their start-up ports. Everything else runs in the second process meanwhile: much of a live
module's time is waiting (Ray and Serve starting, replicas being replaced, autoscaling delays),
which the other half of the suite fills. Each process's output is printed whole when it ends, and
the last line counts both.

With arguments, one pytest runs them as given (`make test ARGS="-k radix"`).
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GROUPS = {"live Ray modules": "ray", "the rest": "not ray"}
COUNTS = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)")
NO_TESTS_RAN = 5


def pytest_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", *args]


def counts(output: str) -> dict[str, int]:
    """The counts of pytest's closing line (`3 failed, 120 passed, 2 skipped in 61.2s`)."""
    lines = [line for line in output.splitlines() if re.search(r" in [\d.]+s", line)]
    if not lines:
        return {}
    found = {kind: int(n) for n, kind in COUNTS.findall(lines[-1])}
    if "error" in found:
        found["errors"] = found.pop("error")
    return found


def combined_status(codes: list[int]) -> int:
    """0 when every group passed; a group that selected nothing (exit 5) is not a failure as long
    as another ran tests."""
    failing = [c for c in codes if c not in (0, NO_TESTS_RAN)]
    if failing:
        return failing[0]
    return NO_TESTS_RAN if all(c == NO_TESTS_RAN for c in codes) else 0


def wait_all(pending: dict, started: float, total: dict[str, int], codes: list[int]) -> None:
    """Print each group's output whole as it ends; add its counts to `total`."""
    while pending:
        for name, (proc, log) in list(pending.items()):
            if proc.poll() is None:
                continue
            del pending[name]
            log.seek(0)
            output = log.read()
            log.close()
            print(f"\n=== run_suite: {name}: exit {proc.returncode} after {time.monotonic() - started:.0f}s")
            print(output, flush=True)
            codes.append(proc.returncode)
            for kind, n in counts(output).items():
                total[kind] = total.get(kind, 0) + n
        time.sleep(1)


def run_groups() -> int:
    logs = Path(tempfile.mkdtemp(prefix="radixserve-suite-"))
    started = time.monotonic()
    procs = {}
    for name, marker in GROUPS.items():
        log = (logs / f"{marker.replace(' ', '-')}.log").open("w+")
        procs[name] = (
            subprocess.Popen(
                pytest_command("-m", marker, "--durations=15"), stdout=log, stderr=subprocess.STDOUT
            ),
            log,
        )
        print(f"run_suite: {name} (-m {marker!r}) started, output in {log.name}", flush=True)
    total: dict[str, int] = {}
    codes: list[int] = []
    pending = dict(procs)
    try:
        wait_all(pending, started, total, codes)
    finally:
        for proc, _log in pending.values():  # interrupted: no half outlives the command
            proc.terminate()
    status = combined_status(codes)
    print(f"run_suite: both halves done in {time.monotonic() - started:.0f}s, exit {status}")
    parts = [f"{total.get('passed', 0)} passed", f"{total.get('failed', 0) + total.get('errors', 0)} failed"]
    if total.get("skipped"):
        parts.append(f"{total['skipped']} skipped")
    print(", ".join(parts))
    return status


def main(argv: list[str]) -> int:
    if argv:
        return subprocess.call(pytest_command(*argv))
    return run_groups()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
