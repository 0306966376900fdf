"""Tensor and expert parallelism on one host, model-level forwards (no engine), side by side:

    python -m load_tests.bench_tp            # ~3 minutes on 2 cores
    python -m load_tests.bench_tp --json results/tp.json

1. The default model (its default dtype): TP=2 (two processes, one thread each, Gloo) against TP=1
   on one thread and on two, a decode step (16 sequences of 128 tokens) and a 256-token prefill;
   per step, the time in all-reduces (2 per layer + the embedding's) and in the logits' all-gather,
   waiting for the slower rank included, and one all-reduce of that step's activation timed alone
   (ranks lined up first): the collective's own cost.
2. A small Qwen3-MoE (8 experts, top-2): EP=2 (each rank 4 experts) and TP=2 EP=1 (each rank
   half of every expert) against EP=1, the same steps.

3. `--engine`: the same comparison through the offline Engine (scheduler, sampler, the batch
   broadcast to the following ranks included): TP=2 (rank 0 here, rank 1 a local process, one
   thread each) against TP=1 on one thread and on two; 16 sequences decoding 64 tokens each, and
   8 prompts of 256 tokens prefilled (one token sampled), with rank 0's time in collectives.

On a 2-core machine TP cannot pay: TP=2 and TP=1 on two threads use the same two cores, and TP
adds the collectives. The point here is what they cost; the correctness is tests/test_tp.py's.
Two threads in one OpenMP team are at the mercy of the neighbours: every parallel region waits
for its slowest thread, so on a shared VM TP=1 on two threads can measure several times slower
than on one. Compare against the one-thread figures there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from load_tests.tiny_moe import tiny_moe_checkpoint
from radixserve.workers.batch_kind import BatchKind
from radixserve.workers.distributed.group import CommGroup
from radixserve.workers.distributed.launch import run_ranks
from radixserve.workers.distributed.parallel import Parallel, ParallelConfig
from radixserve.workers.mem_cache.kv_pool import KVPool
from radixserve.workers.models.forward_batch import ForwardBatch
from radixserve.workers.models.loader import load_model

DECODE_BATCH, DECODE_LEN, PREFILL_LEN = 16, 128, 256


def decode_batch(batch: int, length: int) -> ForwardBatch:
    kv = torch.arange(1, batch * length + 1).view(batch, length)
    return ForwardBatch(
        BatchKind.DECODE,
        torch.randint(100, 40000, (batch,), generator=torch.Generator().manual_seed(0)),
        torch.full((batch,), length - 1),
        kv[:, -1].clone(),
        torch.full((batch,), length),
        torch.ones(batch, dtype=torch.int64),
        kv,
        torch.arange(batch),
        [length] * batch,
        [1] * batch,
    )


def prefill_batch(length: int) -> ForwardBatch:
    slots = torch.arange(1, length + 1)
    return ForwardBatch(
        BatchKind.PREFILL,
        torch.randint(100, 40000, (length,), generator=torch.Generator().manual_seed(1)),
        torch.arange(length),
        slots,
        torch.tensor([length]),
        torch.tensor([length]),
        slots.view(1, length),
        torch.tensor([length - 1]),
        [length],
        [length],
    )


def _step(model, pool, make, group: CommGroup, repeats: int) -> dict:
    times, comm = [], []
    model(make(), pool)  # warm-up
    for _ in range(repeats):
        batch = make()
        group.barrier()  # ranks start together: a step is as slow as its slowest rank
        group.stats.reset()
        start = time.perf_counter()
        model(batch, pool)
        times.append(time.perf_counter() - start)
        comm.append(dict(group.stats.seconds))
    calls = dict(group.stats.calls)
    return {
        "ms": 1e3 * statistics.median(times),
        "best_ms": 1e3 * min(times),
        "all_reduce_ms": 1e3 * statistics.median(c.get("all_reduce", 0.0) for c in comm),
        "all_gather_ms": 1e3 * statistics.median(c.get("all_gather", 0.0) for c in comm),
        "calls": calls,
    }


def all_reduce_alone_ms(group: CommGroup, rows: int, hidden: int, dtype: torch.dtype, repeats: int) -> float:
    """One all-reduce of a [rows, hidden] activation with the ranks lined up by a barrier first:
    the collective's own cost, without the wait for a slower rank that a step's figure includes."""
    x = torch.randn(rows, hidden).to(dtype)
    times = []
    for _ in range(repeats):
        group.barrier()
        start = time.perf_counter()
        group.all_reduce(x)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def forwards_on_rank(group: CommGroup, path: str | None, tp: int, ep: int, repeats: int) -> dict:
    loaded = load_model(path, parallel=Parallel(ParallelConfig(tp, ep), group))
    model, c = loaded.model, loaded.config
    slots = max(DECODE_BATCH * DECODE_LEN, PREFILL_LEN) + 1
    pool = KVPool(c.num_layers, model.local_kv_heads, c.head_dim, slots, dtype=c.dtype)
    with torch.inference_mode():
        res = {
            "dtype": str(c.dtype).removeprefix("torch."),
            "decode": _step(model, pool, lambda: decode_batch(DECODE_BATCH, DECODE_LEN), group, repeats),
            "prefill": _step(model, pool, lambda: prefill_batch(PREFILL_LEN), group, max(3, repeats // 4)),
        }
    for step, rows in (("decode", DECODE_BATCH), ("prefill", PREFILL_LEN)):
        res[step]["one_all_reduce_ms"] = all_reduce_alone_ms(group, rows, c.hidden_size, c.dtype, 5 * repeats)
    return res


def run_layout(path: str | None, tp: int, ep: int, repeats: int, threads: int) -> dict:
    """Rank 0's figures, each rank on `threads` torch threads."""
    return run_ranks(forwards_on_rank, tp, path, tp, ep, repeats, threads=threads)[0]


def _print(label: str, res: dict) -> None:
    for step in ("decode", "prefill"):
        r = res[step]
        comm = r["all_reduce_ms"] + r["all_gather_ms"]
        print(
            f"{label:26s} {step:7s} {r['ms']:8.2f} ms/step (best {r['best_ms']:7.2f})  "
            f"all-reduce {r['all_reduce_ms']:6.2f} ms "
            f"({r['calls'].get('all_reduce', 0)} calls; one alone {r['one_all_reduce_ms']:5.3f} ms)  "
            f"all-gather {r['all_gather_ms']:5.2f} ms  comm {100 * comm / r['ms']:4.1f}%",
            flush=True,
        )


def engine_figures(tp: int, threads: int) -> dict:
    """Decode tokens/s and prefill tokens/s of the offline Engine, and rank 0's collectives."""
    from radixserve.workers import Engine

    engine = Engine(
        tp_size=tp, num_threads=threads, max_total_tokens=16384, disable_radix_cache=True, random_seed=0
    )
    try:
        gen = torch.Generator().manual_seed(2)
        prompts = [torch.randint(100, 40000, (n,), generator=gen).tolist() for n in [32] * 16 + [256] * 8]
        decode, prefill = prompts[:16], prompts[16:]
        engine.generate(input_ids=decode[:2], sampling_params={"max_new_tokens": 4})  # warm-up
        group = engine.core.tp.group
        res = {}
        for name, ids, new in (("decode", decode, 64), ("prefill", prefill, 1)):
            group.stats.reset()
            start = time.perf_counter()
            engine.generate(input_ids=ids, sampling_params={"max_new_tokens": new, "ignore_eos": True})
            wall = time.perf_counter() - start
            tokens = len(ids) * new if name == "decode" else sum(map(len, ids))
            res[name] = {
                "tokens_per_s": tokens / wall,
                "wall_s": wall,
                "collective_s": sum(group.stats.seconds.values()),
                "collective_calls": sum(group.stats.calls.values()),
            }
        return res
    finally:
        engine.shutdown()


def run_engines() -> dict:
    res = {}
    for label, tp, threads in (("TP=1 (1 thr)", 1, 1), ("TP=1 (2 thr)", 1, 2), ("TP=2 (2x1 thr)", 2, 1)):
        res[f"engine {label}"] = r = engine_figures(tp, threads)
        for step in ("decode", "prefill"):
            x = r[step]
            print(
                f"engine {label:16s} {step:7s} {x['tokens_per_s']:8.1f} tok/s  wall {x['wall_s']:6.2f} s  "
                f"collectives {x['collective_s']:6.2f} s ({x['collective_calls']} calls, "
                f"{100 * x['collective_s'] / x['wall_s']:4.1f}%)",
                flush=True,
            )
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--engine", action="store_true", help="through the offline Engine instead")
    args = ap.parse_args(argv)
    res: dict = {}
    if args.engine:
        res = run_engines()
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=2)
        return 0
    layouts = [("TP=1 (1 thr)", 1, 1, 1), ("TP=1 (2 thr)", 1, 1, 2), ("TP=2 (2x1 thr)", 2, 1, 1)]
    for label, tp, ep, threads in layouts:
        res[f"default {label}"] = run_layout(None, tp, ep, args.repeats, threads)
        _print(f"default {label}", res[f"default {label}"])
    moe_layouts = [*layouts[:2], ("EP=2 (2x1 thr)", 2, 2, 1), ("TP=2 EP=1 (2x1 thr)", 2, 1, 1)]
    with tempfile.TemporaryDirectory() as tmp:
        path = tiny_moe_checkpoint(tmp)
        for label, tp, ep, threads in moe_layouts:
            res[f"moe {label}"] = run_layout(path, tp, ep, args.repeats, threads)
            _print(f"moe {label}", res[f"moe {label}"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
