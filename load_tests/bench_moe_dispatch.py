"""How tokens reach the ranks that hold their experts: all-to-all against all-gather + reduce-scatter
(and against the all-reduce the model uses), one MoE block on 2 ranks (Gloo, one thread each).

    python -m load_tests.bench_moe_dispatch            # ~1 minute on 2 cores
    python -m load_tests.bench_moe_dispatch --json results/moe_dispatch.json

Two settings, T tokens per rank:
- tokens partitioned over the ranks (as with data-parallel attention):
    all-to-all:  route own tokens, send each (token, expert) row to the expert's rank, run, send
                 the results back, combine (3 all-to-alls: counts, rows, results);
    ag+rs:       all-gather the tokens, every rank runs its experts on all of them, reduce-scatter.
- tokens replicated (after tensor-parallel attention, what the model has):
    all-reduce:  every rank runs its experts on the tokens routed to them, one all-reduce
                 (SparseMoeBlock.forward);
    a2a+ag:      take this rank's slice of the tokens, all-to-all as above, then all-gather the
                 results so that every rank holds every token again.
Every variant's output is checked against the all-reduce one before it is timed.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from load_tests.tiny_moe import tiny_moe_checkpoint
from radixserve.workers.distributed.group import CommGroup
from radixserve.workers.distributed.launch import run_ranks
from radixserve.workers.distributed.parallel import Parallel, ParallelConfig, shard_range
from radixserve.workers.models.loader import load_model
from radixserve.workers.models.moe import SparseMoeBlock, route


def moe_all_to_all(
    block: SparseMoeBlock, x: torch.Tensor, group: CommGroup, owners: list[range]
) -> torch.Tensor:
    """The block's output for this rank's tokens x, each (token, expert) row sent to its expert's
    rank and back. owners[r]: the expert ids rank r holds (contiguous, in rank order)."""
    weights, ids = route(block.gate(x), block.top_k, block.renormalize)
    weights = weights if block.weights_in_float32 else weights.to(x.dtype)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)  # grouped by expert, hence by owner
    per_expert = torch.bincount(flat, minlength=block.num_experts)
    send = [int(per_expert[r.start : r.stop].sum()) for r in owners]
    local = len(block.local_experts)
    # counts[s, e]: rows source s sends for this rank's e-th expert
    counts = group.all_to_all(per_expert, [len(r) for r in owners], [local] * group.world_size)
    counts = counts.view(group.world_size, local)
    rows = group.all_to_all(x.index_select(0, order // block.top_k), send, counts.sum(1).tolist())
    results = torch.empty_like(rows)
    starts = torch.cat([counts.new_zeros(1), counts.flatten().cumsum(0)[:-1]]).view_as(counts)
    for e, expert_id in enumerate(block.local_experts):
        index = torch.cat(
            [torch.arange(s, s + c) for s, c in zip(starts[:, e].tolist(), counts[:, e].tolist())]
        )
        if index.numel():
            results[index] = block.experts[str(expert_id)](rows[index])
    back = group.all_to_all(results, counts.sum(1).tolist(), send)
    out = torch.zeros_like(x)
    out.index_add_(0, order // block.top_k, (back * weights.flatten()[order].unsqueeze(1)).to(x.dtype))
    return out


def _variants(block, group: CommGroup, owners: list[range], mine, everyone) -> dict:
    return {
        "all_to_all": lambda: moe_all_to_all(block, mine, group, owners),
        "ag_rs": lambda: group.reduce_scatter(block.partial(group.all_gather(mine))),
        "all_reduce": lambda: block(everyone),
        "a2a_ag": lambda: group.all_gather(moe_all_to_all(block, mine, group, owners)),
    }


def _best_ms(fn, group: CommGroup, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        group.barrier()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return 1e3 * best


def dispatch_on_rank(group: CommGroup, path: str, tokens_per_rank: list[int], repeats: int) -> dict:
    n, rank = group.world_size, group.rank
    loaded = load_model(path, dtype="float32", parallel=Parallel(ParallelConfig(n, n), group))
    block = loaded.model.model.layers[0].mlp
    owners = [range(*shard_range(block.num_experts, n, r)) for r in range(n)]
    out = {}
    for t in tokens_per_rank:
        gen = torch.Generator().manual_seed(t)
        everyone = torch.randn(n * t, loaded.config.hidden_size, generator=gen)
        mine = everyone[rank * t : (rank + 1) * t]
        with torch.inference_mode():
            reference = block(everyone)
            variants = _variants(block, group, owners, mine, everyone)
            for name, fn in variants.items():
                expected = (
                    reference if name in ("all_reduce", "a2a_ag") else reference[rank * t : (rank + 1) * t]
                )
                torch.testing.assert_close(fn(), expected, atol=1e-5, rtol=1e-4)
            out[t] = {name: _best_ms(fn, group, repeats) for name, fn in variants.items()}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,16,256", help="tokens per rank")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        path = tiny_moe_checkpoint(tmp)
        results = run_ranks(dispatch_on_rank, 2, path, tokens, args.repeats)[0]
    for t, row in results.items():
        print(
            f"T={t:4d} per rank  partitioned: all-to-all {row['all_to_all']:7.2f} ms  ag+rs {row['ag_rs']:7.2f} ms"
            f"  | replicated: all-reduce {row['all_reduce']:7.2f} ms  a2a+ag {row['a2a_ag']:7.2f} ms",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
