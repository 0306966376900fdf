"""Where the packed bf16 GEMM (csrc/gemm.h) stops paying: the row count from which torch's matmul
(oneDNN) is faster on this machine, measured once per process and shape set.

The packed kernel reads each weight strip once per 16 rows of x with those rows' accumulators in
registers, which is what decode needs (M = 1..64: 1.7-2.6x oneDNN on the 2-core dev VM). At
prefill sizes oneDNN's cache blocking catches up: the dev VM measured 1.07x at 256 rows and 0.96x
at 512 for whole default-model forwards. Where oneDNN has AMX the crossover is far lower, so it is
measured on the machine rather than written down.

The probe times both paths on random weights of the model's own shapes, from the largest row count
down, and stops at the first count where the packed kernel is not beaten. Each time is the minimum
over a few calls, the two paths alternating: a neighbour stealing the CPU only ever adds time, so
the minimum is the least disturbed measurement, and alternating exposes both paths to the same
neighbours. For the default model's shapes on the 2-core dev VM the probe took 0.1-0.4 s (4-6 s
with the cores oversubscribed five-fold) and found no crossover: torch's lead at 512 rows stays
under the margin, so the packed copy alone serves every size. On a VM whose neighbours burst for
longer than the probe, even these timings can mislead it (once in four runs there it found 512);
$RADIXSERVE_GEMM_CROSSOVER pins the decision where a replica's footprint must not vary.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping

import torch
import torch.nn.functional as F

from radixserve.kernels import cpu_ops

# Row counts probed, largest first. Below 64 rows the packed kernel wins on every CPU it runs on
# (it exists because oneDNN's small-M bf16 GEMMs reach a third of the peak). Nothing above 512:
# a crossover that high would buy a few per cent of long prefills for a second copy of the
# weights, and the probe's cost grows with the rows.
PROBE_ROWS = (512, 256, 128, 64)
# torch must be at least this much faster to count as a win: a second copy of the weights is not
# worth a smaller gain, and the margin keeps timing noise from flipping the decision (and with it
# the replica's memory footprint) from one start to the next. On the 2-core dev VM torch led by
# 4-7% at 512 rows, and a 5% margin flipped between runs.
WIN_MARGIN = 0.10
REPEATS = 5
# Operators can pin the decision: a row count, or "none" for the packed kernel at every size.
ENV_OVERRIDE = "RADIXSERVE_GEMM_CROSSOVER"

Timer = Callable[[int], tuple[float, float]]  # rows -> (packed seconds, torch seconds)


def choose_crossover(timings: Mapping[int, tuple[float, float]], margin: float = WIN_MARGIN) -> int | None:
    """The smallest probed row count from which torch beats the packed kernel by `margin` at that
    count and at every larger probed count; None when the packed kernel holds at the largest."""
    crossover = None
    for rows in sorted(timings, reverse=True):
        packed_s, torch_s = timings[rows]
        if torch_s * (1.0 + margin) > packed_s:
            break
        crossover = rows
    return crossover


def probe(timer: Timer, rows_desc: Iterable[int] = PROBE_ROWS, margin: float = WIN_MARGIN) -> int | None:
    """Run `timer` from the largest row count down, stopping where the packed kernel holds."""
    timings: dict[int, tuple[float, float]] = {}
    for rows in rows_desc:
        timings[rows] = timer(rows)
        packed_s, torch_s = timings[rows]
        if torch_s * (1.0 + margin) > packed_s:
            break
    return choose_crossover(timings, margin)


def _min_times(first: Callable[[], object], second: Callable[[], object]) -> tuple[float, float]:
    """Minimum time of each over REPEATS calls, alternating, so both see the same neighbours."""
    first()  # warm-up: first-touch pages, oneDNN primitive creation
    second()
    best = [float("inf"), float("inf")]
    for _ in range(REPEATS):
        for i, fn in enumerate((first, second)):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best[0], best[1]


def shape_timer(shapes: Iterable[tuple[int, int]]) -> Timer:
    """Time both paths over one (in_features, out_features) weight of each shape."""
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen).to(torch.bfloat16) for k, n in shapes]
    packed = [cpu_ops.pack_linear_weight(w) for w in weights]
    native = cpu_ops.native_ops()
    if native is None:
        raise RuntimeError("the packed GEMM probe needs the CPU extension")

    def timer(rows: int) -> tuple[float, float]:
        xs = {w.shape[1]: torch.randn(rows, w.shape[1], generator=gen).to(torch.bfloat16) for w in weights}

        def run_packed() -> None:
            for w, p in zip(weights, packed):
                native.packed_linear(xs[w.shape[1]], p, w.shape[0], None)

        def run_torch() -> None:
            for w in weights:
                F.linear(xs[w.shape[1]], w)

        return _min_times(run_packed, run_torch)

    return timer


@functools.lru_cache(maxsize=16)
def _measured(shapes: tuple[tuple[int, int], ...], threads: int) -> int | None:
    result: list[int | None] = []
    # A thread that exits afterwards: the probe's OpenMP team must not outlive it (a second team in
    # the process makes the forward's team sleep between parallel regions).
    worker = threading.Thread(
        target=lambda: result.append(probe(shape_timer(shapes))), name="radixserve-gemm-probe"
    )
    worker.start()
    worker.join()
    if not result:
        raise RuntimeError("the GEMM crossover probe failed (see the thread's traceback above)")
    return result[0]


def packed_crossover(shapes: Iterable[tuple[int, int]]) -> int | None:
    """Rows from which torch's matmul should replace the packed kernel for these (in, out) shapes
    on this machine at the current torch thread count; None = the packed kernel at every size.

    $RADIXSERVE_GEMM_CROSSOVER pins it ("none" or a row count). Measured once per process.
    """
    pinned = os.environ.get(ENV_OVERRIDE, "").strip().lower()
    if pinned:
        if pinned == "none":
            return None
        if not pinned.isdigit() or int(pinned) < 1:
            raise ValueError(f"{ENV_OVERRIDE} must be 'none' or a positive row count, got {pinned!r}")
        return int(pinned)
    if not cpu_ops.gemm_available(torch.bfloat16):
        return None
    return _measured(tuple(sorted(set(shapes))), torch.get_num_threads())
