"""Hot ops only, importing nothing else of RadixServe: fused CPU C++ kernels (csrc/, built at
first use) with plain-torch fallbacks that compute the same thing (`cpu_ops`)."""

import os
import sys

_WAIT_SETTINGS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def _openmp_loaded() -> bool:
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            return any("libgomp" in line for line in f)
    except OSError:  # no procfs: torch loads libgomp, so its presence stands for it
        return "torch" in sys.modules


# True when libgomp was loaded (torch imported) before this module, with no wait setting of the
# user's: the spin count below then comes too late, and idle OpenMP workers spin at libgomp's
# default. The CPU engine warns (measured: batch-8 decode steps of the default model 18-19 ms
# against 13-14 ms).
OPENMP_SPIN_UNSET = not any(v in os.environ for v in _WAIT_SETTINGS) and _openmp_loaded()

# How long an idle OpenMP worker spins before it sleeps, read once when torch loads libgomp.
# libgomp's default (300,000 polls, milliseconds) keeps the workers of torch's ops spinning on
# the cores that the kernels' own pool (csrc/work_pool.h) computes on next: a batch-1 decode step
# of the default model took 1.5-2x as long. 1,000 polls is a few microseconds, after which an idle
# worker sleeps. Set before torch is first imported (the `workers` and `cluster` packages import
# this one first); a value the user set is kept.
os.environ.setdefault("GOMP_SPINCOUNT", "1000")
