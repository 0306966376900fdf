"""Multi-LoRA throughput, side by side in one run on one engine (default model, offline API):

- base: --batch requests of the base model (the LoRA buffers exist, no adapter runs);
- one adapter: the same requests, all under one adapter (the single-slot path);
- mixed: the same requests spread over --adapters adapters (every step mixes them all);
- one replica per adapter: each adapter's share of the batch (batch / adapters requests) run as
  its own batch, one adapter after another: what --adapters replicas of the base model with
  the adapter merged would do on the same cores, each getting 1/adapters of the machine;

and the memory one loaded adapter takes (its weights in memory; a batch slot's buffers), and the
machine's floor: its measured fp32 GEMM rate and memory bandwidth. Adapters are made here with
PEFT (seeded random weights, all seven projections by default).

    python -m load_tests.bench_lora [--batch 32] [--adapters 8] [--rank 16] [--targets all|qv]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time

import torch

from radixserve.workers.engine.engine import Engine
from radixserve.workers.models.loader import resolve_model_dir

TARGETS = {
    "all": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "qv": ["q_proj", "v_proj"],
}


def make_adapters(base: str, root: str, count: int, rank: int, targets: list[str]) -> dict[str, str]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = {}
    for i in range(count):
        hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, local_files_only=True)
        model = get_peft_model(hf, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))
        gen = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        path = f"{root}/ad{i}"
        model.save_pretrained(path)
        out[f"ad{i}"] = path
    return out


def floor() -> dict[str, float]:
    """The machine's fp32 GEMM rate (GFLOP/s, 1024^3) and copy bandwidth (GB/s, 256 MiB)."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    a @ b
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    gflops = 10 * 2 * 1024**3 / (time.perf_counter() - t) / 1e9
    src = torch.empty(64 << 20, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    gbs = 5 * 2 * src.numel() * 4 / (time.perf_counter() - t) / 1e9
    return {"gemm_gflops": round(gflops, 1), "copy_gb_s": round(gbs, 1)}


def run(engine: Engine, prompts: list[list[int]], loras: list[str | None], new: int) -> float:
    """Output tokens per second of the requests run together."""
    params = {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}

    async def all_at_once():
        return await asyncio.gather(
            *(
                engine.async_generate(input_ids=p, sampling_params=params, lora_path=lo)
                for p, lo in zip(prompts, loras)
            )
        )

    t = time.perf_counter()
    outs = asyncio.run(all_at_once())
    wall = time.perf_counter() - t
    assert all(len(o["output_ids"]) == new for o in outs)
    return len(prompts) * new / wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", choices=list(TARGETS), default="all")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="each workload's best of this many runs")
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    base = str(resolve_model_dir(None)[0])
    root = tempfile.mkdtemp(prefix="bench-lora-")
    adapters = make_adapters(base, root, args.adapters, args.rank, TARGETS[args.targets])
    engine = Engine(
        dtype=args.dtype,
        max_total_tokens=args.batch * (args.prompt_len + args.new_tokens) + 1024,
        max_running_requests=args.batch,
        lora_paths=tuple(f"{n}={p}" for n, p in adapters.items()),
        max_loras_per_batch=args.adapters,
        max_lora_rank=args.rank,
        disable_radix_cache=True,  # every run computes its prompts: no run feeds the next
    )
    try:
        gen = torch.Generator().manual_seed(0)
        prompts = [
            torch.randint(100, 40000, (args.prompt_len,), generator=gen).tolist() for _ in range(args.batch)
        ]
        names = list(adapters)
        share = args.batch // args.adapters
        workloads = {
            "base": lambda: run(engine, prompts, [None] * args.batch, args.new_tokens),
            "one_adapter": lambda: run(engine, prompts, [names[0]] * args.batch, args.new_tokens),
            "mixed": lambda: run(
                engine, prompts, [names[i % args.adapters] for i in range(args.batch)], args.new_tokens
            ),
            # Each adapter's share as its own batch, one after another: tokens / summed time.
            "replica_per_adapter": lambda: (
                args.batch
                * args.new_tokens
                / sum(
                    share
                    * args.new_tokens
                    / run(engine, prompts[k * share : (k + 1) * share], [None] * share, args.new_tokens)
                    for k in range(args.adapters)
                )
            ),
        }
        run(engine, prompts[:4], [None, *names[:3]], 8)  # warm-up: every path once
        results = {name: 0.0 for name in workloads}
        for _ in range(args.rounds):  # interleaved rounds: drift hits every workload alike
            for name, fn in workloads.items():
                results[name] = max(results[name], fn())
        lora = engine.core.lora
        assert lora is not None
        report = {
            "batch": args.batch,
            "adapters": args.adapters,
            "rank": args.rank,
            "targets": args.targets,
            "dtype": str(engine.model_config.dtype),
            "tokens_per_s": {k: round(v, 1) for k, v in results.items()},
            "mixed_vs_base": round(results["mixed"] / results["base"], 3),
            "one_adapter_vs_base": round(results["one_adapter"] / results["base"], 3),
            "mixed_vs_replica_per_adapter": round(results["mixed"] / results["replica_per_adapter"], 3),
            "adapter_mib_in_memory": round(lora.loaded_bytes()[names[0]] / 2**20, 2),
            "slot_buffers_mib": round(lora.nbytes / 2**20, 1),
            "machine": floor(),
        }
        print(json.dumps(report, indent=2))
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
