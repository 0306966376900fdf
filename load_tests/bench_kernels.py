"""CPU kernel micro-benchmarks, each side by side with what it replaced, in one run.

    python -m load_tests.bench_kernels            # ~1 minute on 2 cores
    python -m load_tests.bench_kernels --json results/kernels.json

1. Projections: the packed AVX512-BF16 GEMM (kernels/csrc/gemm.h) against torch's matmul over
   all of the default model's projections plus its LM head, at decode and prefill row counts, and
   the crossover row count that the model loader's probe (kernels/gemm_crossover.py) picks here.
2. Decode attention: the native kernel against the torch fallback (gather + two batched matmuls),
   over a paged pool with unrelated sequences and with sequences sharing a 1000-token prefix; and
   a whole step's attention (30 layers' pools) at the serving benchmarks' sizes, with the K/V
   bytes it reads and their rate.
3. OpenMP teams: one decode forward timed on the thread that loaded the model's team and on a
   thread started after another thread's team exists (workers/executor/cpu_runtime.py explains why the
   engine loads on a short-lived thread).
"""

from __future__ import annotations

import argparse
import json
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from radixserve.kernels import cpu_ops
from radixserve.kernels.gemm_crossover import packed_crossover

# SmolLM2-135M: (in, out) of one layer's fused projections, 30 layers, the tied LM head.
LAYER_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
LAYERS = 30
LM_HEAD = (576, 49152)


def timed(fn: Callable[[], Any], seconds: float = 1.0) -> float:
    """Best mean time per call (s) over short batches, after a warm-up."""
    fn()
    fn()
    best = math.inf
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        for _ in range(3):
            fn()
        best = min(best, (time.perf_counter() - t) / 3)
    return best


def bench_gemm(rows_list: list[int]) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    weights = [
        [torch.randn(n, k, generator=gen).to(torch.bfloat16) for k, n in LAYER_SHAPES] for _ in range(LAYERS)
    ]
    head = torch.randn(LM_HEAD[1], LM_HEAD[0], generator=gen).to(torch.bfloat16)
    packed = [[cpu_ops.pack_linear_weight(w) for w in layer] for layer in weights]
    packed_head = cpu_ops.pack_linear_weight(head)
    native = cpu_ops.native_ops()
    out = {}
    for m in rows_list:
        xs = {k: torch.randn(m, k, generator=gen).to(torch.bfloat16) for k in (576, 1536)}
        with_head = m <= 64  # the LM head only sees the sampled rows

        def torch_mm(xs=xs, with_head=with_head):
            for layer in weights:
                for w in layer:
                    F.linear(xs[w.shape[1]], w)
            if with_head:
                F.linear(xs[576], head)

        def packed_mm(xs=xs, with_head=with_head):
            for layer, pl in zip(weights, packed):
                for w, p in zip(layer, pl):
                    native.packed_linear(xs[w.shape[1]], p, w.shape[0], None)
            if with_head:
                native.packed_linear(xs[576], packed_head, head.shape[0], None)

        flops = (
            2 * m * (LAYERS * sum(k * n for k, n in LAYER_SHAPES) + (math.prod(LM_HEAD) if with_head else 0))
        )
        t_torch, t_packed = timed(torch_mm), timed(packed_mm)
        out[m] = {
            "torch_ms": 1e3 * t_torch,
            "packed_ms": 1e3 * t_packed,
            "speedup": t_torch / t_packed,
            "torch_gflops": flops / t_torch / 1e9,
            "packed_gflops": flops / t_packed / 1e9,
        }
        print(
            f"GEMM M={m:4d}: torch {1e3 * t_torch:7.2f} ms ({flops / t_torch / 1e9:5.0f} GFLOP/s)  "
            f"packed {1e3 * t_packed:7.2f} ms ({flops / t_packed / 1e9:5.0f} GFLOP/s)  "
            f"{t_torch / t_packed:.2f}x",
            flush=True,
        )
    return out


def bench_decode_attention(batch: int, length: int, shared: int) -> dict[str, Any]:
    """`batch` sequences of `length` tokens; groups of 8 share their first `shared` slots."""
    gen = torch.Generator().manual_seed(1)
    rows, next_slot, prefix = [], 1, None
    for b in range(batch):
        if b % 8 == 0 and shared:
            prefix = list(range(next_slot, next_slot + shared))
            next_slot += shared
        own = length - (shared if prefix else 0)
        rows.append((prefix or []) + list(range(next_slot, next_slot + own)))
        next_slot += own
    k_buf = torch.randn(next_slot, 3, 64, generator=gen).to(torch.bfloat16)
    v_buf = torch.randn(next_slot, 3, 64, generator=gen).to(torch.bfloat16)
    kv = torch.tensor(rows)
    lens = torch.full((batch,), length)
    q = torch.randn(batch, 9, 64, generator=gen).to(torch.bfloat16)
    scale = 1 / math.sqrt(64)
    native = cpu_ops.native_ops()
    t_native = timed(lambda: native.decode_attention(q, k_buf, v_buf, kv, lens, scale))
    t_torch = timed(lambda: cpu_ops.decode_attention_torch(q, k_buf, v_buf, kv, lens))
    label = f"B={batch} L={length}" + (f" (groups of 8 share {shared})" if shared else "")
    print(
        f"decode attention {label}: native {1e6 * t_native:8.1f} us  torch {1e6 * t_torch:8.1f} us per layer  "
        f"{t_torch / t_native:.1f}x",
        flush=True,
    )
    return {"native_us": 1e6 * t_native, "torch_us": 1e6 * t_torch}


def bench_decode_attention_step(
    batch: int, length: int, shared: int, layers: int = LAYERS, int8: bool = False, groups: int = 1
) -> dict[str, Any]:
    """A whole decode step's attention: `layers` layers, each with a K/V pool of its own (as the
    model's), so that the step reads its K/V from memory rather than from a cache that one
    layer's pool fits; the sequences share their first `shared` slots in `groups` groups
    (sequence b in group b % groups, as a shared-prompt load interleaves them). Prints the K/V
    bytes the step reads once per sequence and the rate that makes. `int8`: the int8 pool
    (kv_cache_dtype int8, csrc/kv_int8.h), 68 bytes a row against bf16's 128."""
    gen = torch.Generator().manual_seed(2)
    own = length - shared
    slots = groups * shared + batch * own
    rows = [
        list(range((b % groups) * shared, (b % groups + 1) * shared))
        + list(range(groups * shared + b * own, groups * shared + (b + 1) * own))
        for b in range(batch)
    ]
    kv, lens = torch.tensor(rows), torch.full((batch,), length)

    def pool() -> torch.Tensor:
        values = torch.randn(slots, 3, 64, generator=gen).to(torch.bfloat16)
        return cpu_ops.kv_int8_rows(values) if int8 else values

    k_bufs = [pool() for _ in range(layers)]
    v_bufs = [pool() for _ in range(layers)]
    q = torch.randn(batch, 9, 64, generator=gen).to(torch.bfloat16)
    native, scale = cpu_ops.native_ops(), 1 / math.sqrt(64)

    def step() -> None:
        for k_buf, v_buf in zip(k_bufs, v_bufs):
            native.decode_attention(q, k_buf, v_buf, kv, lens, scale)

    t = timed(step)
    read = batch * length * 3 * k_bufs[0][0, 0].nbytes * 2 * layers  # K and V rows per sequence
    label = (
        f"B={batch} L={length}"
        + (f" (all share {shared})" if shared and groups == 1 else "")
        + (f" ({groups} groups share {shared})" if shared and groups > 1 else "")
        + (", int8 pool" if int8 else "")
    )
    print(
        f"decode attention step, {layers} layers, {label}: {1e3 * t:6.2f} ms, "
        f"{read / 1e6:.0f} MB of K/V rows read, {read / t / 1e9:.1f} GB/s",
        flush=True,
    )
    return {"ms": 1e3 * t, "kv_mb": read / 1e6}


def bench_openmp_teams(batch: int = 16, length: int = 100) -> dict[str, Any]:
    """A decode forward of the default model on the thread whose OpenMP team is the only one,
    then on a new thread while another thread's team exists."""
    from radixserve.workers.batch_kind import BatchKind
    from radixserve.workers.mem_cache.kv_pool import KVPool
    from radixserve.workers.models.forward_batch import ForwardBatch
    from radixserve.workers.models.loader import load_model

    results: dict[str, float] = {}
    state: dict[str, Any] = {}

    def load_and_time() -> None:  # this thread then owns the process's only team
        loaded = load_model(None)
        c = loaded.config
        pool = KVPool(c.num_layers, c.num_kv_heads, c.head_dim, batch * length + 8, dtype=c.dtype)
        kv = torch.arange(1, batch * length + 1).view(batch, length)

        def forward() -> None:
            b = ForwardBatch(
                BatchKind.DECODE,
                torch.randint(100, 40000, (batch,)),
                torch.full((batch,), length - 1),
                kv[:, -1].clone(),
                torch.full((batch,), length),
                torch.ones(batch, dtype=torch.int64),
                kv.clone(),
                torch.arange(batch),
                [length] * batch,
                [1] * batch,
            )
            with torch.inference_mode():
                loaded.model(b, pool)

        state["forward"] = forward
        results["one_team_ms"] = 1e3 * timed(forward, 3.0)

    loader = threading.Thread(target=load_and_time)
    loader.start()
    loader.join()
    # The main thread runs one parallel op (its own team now exists), then a new thread forwards.
    torch.randn(4096, 4096).sum()
    other = threading.Thread(
        target=lambda: results.__setitem__("two_teams_ms", 1e3 * timed(state["forward"], 3.0))
    )
    other.start()
    other.join()
    print(
        f"decode forward B={batch} L={length}: one OpenMP team {results['one_team_ms']:.1f} ms, "
        f"two teams {results['two_teams_ms']:.1f} ms",
        flush=True,
    )
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,16,64,512", help="GEMM row counts")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    if not cpu_ops.gemm_available(torch.bfloat16):
        print("this CPU (or build) has no AVX512-BF16 packed GEMM; nothing to compare")
        return 1
    res: dict[str, Any] = {"threads": torch.get_num_threads()}

    # Kernels first, on a short-lived thread: the team test below needs a process without one.
    def kernels() -> None:
        res["gemm"] = bench_gemm([int(r) for r in args.rows.split(",")])
        res["gemm_crossover_rows"] = packed_crossover(LAYER_SHAPES)
        print(f"GEMM crossover the model loader picks here: {res['gemm_crossover_rows']} rows", flush=True)
        res["decode_attention"] = {
            "unrelated": bench_decode_attention(16, 100, 0),
            "shared_prefix": bench_decode_attention(64, 1100, 1000),
            # the serving benchmarks' shared-prompt workload: 8 running, ~767 tokens each
            "step_unrelated": bench_decode_attention_step(8, 767, 0),
            "step_shared_prefix": bench_decode_attention_step(8, 767, 700),
            "step_4_shared_prefixes": bench_decode_attention_step(8, 767, 700, groups=4),
            # kv_cache_dtype int8 at the same size, and both at a longer context
            "step_unrelated_int8": bench_decode_attention_step(8, 767, 0, int8=True),
            "step_4k": bench_decode_attention_step(8, 4000, 0),
            "step_4k_int8": bench_decode_attention_step(8, 4000, 0, int8=True),
        }

    worker = threading.Thread(target=kernels)
    worker.start()
    worker.join()
    res["openmp_teams"] = bench_openmp_teams()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
