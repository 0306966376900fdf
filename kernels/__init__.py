"""Hot ops only, importing nothing else of RadixServe: fused CPU C++ kernels (csrc/, built at
first use) with plain-torch fallbacks that compute the same thing (`cpu_ops`)."""

import os

# How long an idle OpenMP worker spins before it sleeps, read once when torch loads libgomp.
# libgomp's default (300,000 polls, milliseconds) keeps the workers of torch's ops spinning on
# the cores that the kernels' own pool (csrc/work_pool.h) computes on next: a batch-1 decode step
# of the default model took 1.5-2x as long. 1,000 polls is a few microseconds, after which an idle
# worker sleeps. Set before torch is first imported (the `workers` and `cluster` packages import
# this one first); a value the user set is kept.
os.environ.setdefault("GOMP_SPINCOUNT", "1000")
