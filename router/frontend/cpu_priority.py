"""The serving processes beside the engines run at a lower CPU priority (`--service-nice`).

On a node whose engine forwards on the CPU, the forward is a team of threads that meet at a
barrier after every parallel region, hundreds of times a step: when any one of them loses its core
to another process for a scheduler slice, the whole team waits. The ingress, Serve's HTTP proxy
and its controller need little CPU (a few percent of a node under load) but wake often; at the
engines' priority they cut into the forward's regions. At a higher nice value they still run
whenever a core is idle and get their share under contention, but no longer preempt an engine
thread. (load_tests/bench_step_loop.py --contend, the default model on 2 cores: a batch-8 decode
forward took 46-49 ms alone, 82-95 ms beside two processes busy 20% of the time at nice 0, and
60-67 ms with them at nice 10.)

Linux keeps the nice value per thread: a process is reniced thread by thread, and the threads it
starts later inherit it from their creator. Only ever lowers priority (raises nice), which needs
no privilege. Elsewhere than Linux this does nothing.
"""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger(__name__)

# Process titles Ray gives the Serve actors that forward and control, not compute.
SERVE_SERVICE_TITLES = ("ray::ProxyActor", "ray::ServeController")


def renice_process(pid: int, nice: int) -> int:
    """Raise every thread of `pid` to at least `nice` (a thread already nicer keeps its value);
    returns how many threads were changed. Threads that vanish or refuse are skipped."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return 0
    changed = 0
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
                changed += 1
        except OSError:
            continue
    return changed


def processes_titled(prefixes: tuple[str, ...]) -> list[int]:
    """This node's processes of this user whose title (argv) starts with one of `prefixes`."""
    if not sys.platform.startswith("linux"):
        return []
    uid = os.getuid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != uid:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                title = f.read(256).split(b"\0", 1)[0].decode(errors="replace")
        except OSError:
            continue
        if title.startswith(prefixes):
            found.append(int(entry))
    return found


def lower_service_priority(nice: int) -> int:
    """Renice this process and Serve's proxy and controller on this node to `nice` (0: nothing);
    returns how many threads changed. Called by each ingress replica as it starts."""
    if nice <= 0:
        return 0
    pids = {os.getpid(), *processes_titled(SERVE_SERVICE_TITLES)}
    changed = sum(renice_process(pid, nice) for pid in pids)
    logger.info("service processes %s at nice %d (%d threads changed)", sorted(pids), nice, changed)
    return changed
