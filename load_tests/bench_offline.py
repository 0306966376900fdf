"""Offline throughput of the engine, side by side in one run.

Workloads:
  shared-prefix  G groups x Q questions; each group has an S-token system prompt, each question
                 L tokens; O output tokens each (ignore_eos).
  random         N unrelated prompts of R tokens; O output tokens each.
Systems: this engine (radix cache on), this engine with the radix cache off, and Hugging Face
`generate` (same dtype, batches of --hf-batch, left padding).
Also: the machine's measured bf16 GEMM peak, prefill throughput as a share of it, and decode
throughput at batch 16 against Hugging Face `generate` at batch 16.

    python -m load_tests.bench_offline                 # the full set (several minutes on 2 cores)
    python -m load_tests.bench_offline --scale 0.25    # a quick look
    python -m load_tests.bench_offline --overlap both  # overlap mode on vs off, same workloads

With --overlap, only the overlap comparison runs: one engine per mode in turn (never two at
once), --repeats rounds alternating which mode goes first, best and median reported, so that
load from other processes hits both modes alike.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from typing import Any

import torch

from radixserve.workers.executor.cpu_runtime import on_short_lived_thread


def gemm_peak(dtype: torch.dtype, n: int = 2048, seconds: float = 3.0) -> float:
    """Measured FLOP/s of a large square matmul (the best of several timed runs)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(3):
        a @ b
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        a @ b
        best = max(best, 2 * n**3 / (time.perf_counter() - t))
    return best


def words(rng: random.Random, n: int) -> list[int]:
    """n token ids of plausible text (random vocabulary words), no special tokens."""
    vocab = [i for i in range(1000, 40000)]
    return [rng.choice(vocab) for _ in range(n)]


def shared_prefix_workload(tok, groups, per_group, sys_len, q_len, seed=0):
    rng = random.Random(seed)
    prompts = []
    for _ in range(groups):
        system = words(rng, sys_len)
        prompts += [system + words(rng, q_len) for _ in range(per_group)]
    return prompts


def random_workload(tok, n, length, seed=1):
    rng = random.Random(seed)
    return [words(rng, length) for _ in range(n)]


def run_engine(engine, prompts, out_len) -> dict[str, Any]:
    engine.flush_cache()
    before = engine.stats()
    params = {"max_new_tokens": out_len, "temperature": 0, "ignore_eos": True}
    t = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    dt = time.perf_counter() - t
    after = engine.stats()
    gen = sum(o["meta_info"]["completion_tokens"] for o in outs)
    cached = sum(o["meta_info"]["cached_tokens"] for o in outs)
    inp = sum(len(p) for p in prompts)
    return {
        "seconds": dt,
        "output_tok_s": gen / dt,
        "total_tok_s": (gen + inp) / dt,
        "req_s": len(prompts) / dt,
        "cached_tokens": cached,
        "input_tokens": inp,
        "computed_prefill_tokens": after["computed_tokens_total"] - before["computed_tokens_total"],
        "decode_forward_ms_avg": after.get("decode_forward_ms_avg"),
        "decode_batch_avg": after.get("decode_batch_size_avg"),
    }


def run_hf(model, prompts, out_len, batch) -> dict[str, Any]:
    t = time.perf_counter()
    gen = 0
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            chunk = prompts[i : i + batch]
            width = max(len(p) for p in chunk)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=out_len,
                min_new_tokens=out_len,
                do_sample=False,
                pad_token_id=0,
            )
            gen += (out.shape[1] - width) * len(chunk)
    dt = time.perf_counter() - t
    inp = sum(len(p) for p in prompts)
    return {
        "seconds": dt,
        "output_tok_s": gen / dt,
        "total_tok_s": (gen + inp) / dt,
        "req_s": len(prompts) / dt,
    }


def prefill_rate(engine, tok, n, length) -> float:
    """Prompt tokens/s with nothing cached and one output token per request."""
    prompts = random_workload(tok, n, length, seed=7)
    engine.flush_cache()
    t = time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 1, "temperature": 0})
    return sum(map(len, prompts)) / (time.perf_counter() - t)


def overlap_workloads(tok, scale: float) -> dict[str, tuple[list[list[int]], int]]:
    """Decode-heavy batches (where per-step host work matters most) and a prefill-heavy mix."""
    n = lambda k: max(2, int(k * scale))
    return {
        "decode_b16": (random_workload(tok, n(16), 32, seed=3), 96),
        "decode_b64": (random_workload(tok, n(64), 32, seed=4), 48),
        "mixed": (random_workload(tok, n(32), 256, seed=5), 32),
    }


def bench_overlap(args) -> dict[str, Any]:
    """Each mode in turn on an engine of its own, `--repeats` rounds alternating the modes. One
    engine at a time: two engines in one process each keep an OpenMP team, which throttles both
    (see workers/executor/cpu_runtime.py), so side-by-side engines would measure that instead."""
    from radixserve.workers import Engine

    modes = {"on": [True], "off": [False], "both": [False, True]}[args.overlap]
    label = {True: "overlap on", False: "overlap off"}
    res: dict[str, Any] = {"threads": torch.get_num_threads()}
    rates: dict[str, dict[bool, list[float]]] = {}
    steps: dict[bool, dict[str, Any]] = {}
    workloads = None
    for k in range(args.repeats):
        for m in modes if k % 2 == 0 else modes[::-1]:
            engine = Engine(
                args.model_path,
                max_total_tokens=args.max_total_tokens,
                max_running_requests=64,
                enable_overlap=m,
            )
            workloads = workloads or overlap_workloads(engine.tokenizer, args.scale)
            for name, (prompts, out_len) in workloads.items():
                run_engine(engine, prompts[:2], 4)  # warm-up
                r = run_engine(engine, prompts, out_len)
                rates.setdefault(name, {x: [] for x in modes})[m].append(r["output_tok_s"])
            steps[m] = engine.stats()
            engine.shutdown()
    for name, by_mode in rates.items():
        prompts, out_len = workloads[name]
        row = {
            label[m]: {
                "best_output_tok_s": max(v),
                "median_output_tok_s": sorted(v)[len(v) // 2],
                "runs": v,
                "host_hidden_fraction": steps[m]["step_host_hidden_fraction"],
            }
            for m, v in by_mode.items()
        }
        res[name] = row
        cells = "  ".join(
            f"{label[m]}: best {max(v):7.1f} median {sorted(v)[len(v) // 2]:7.1f} tok/s"
            for m, v in by_mode.items()
        )
        extra = ""
        if len(modes) == 2:
            ratio = max(by_mode[True]) / max(by_mode[False])
            row["on_vs_off_best"] = ratio
            extra = f"  on/off {ratio:.3f}x"
        print(f"{name:>11} ({len(prompts)} reqs x {out_len} out): {cells}{extra}", flush=True)
    for m, stats in steps.items():
        print(
            f"{label[m]}: decode forward {stats.get('decode_forward_ms_avg')} ms, "
            f"schedule {stats.get('decode_schedule_ms_avg')} ms, text {stats.get('decode_text_ms_avg')} "
            f"ms, hidden {stats.get('decode_hidden_ms_avg')} ms per decode step",
            flush=True,
        )
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply request counts")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--per-group", type=int, default=16)
    ap.add_argument("--system-len", type=int, default=1000)
    ap.add_argument("--question-len", type=int, default=32)
    ap.add_argument("--random-n", type=int, default=64)
    ap.add_argument("--random-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--max-total-tokens", type=int, default=200_000)
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument(
        "--overlap",
        choices=("on", "off", "both"),
        help="only compare the engine with overlap mode on / off / both",
    )
    ap.add_argument("--repeats", type=int, default=3, help="runs per mode and workload (--overlap)")
    args = ap.parse_args(argv)
    if args.overlap:
        res = bench_overlap(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=2)
        return 0

    from radixserve.workers import Engine

    res: dict[str, Any] = {}
    engine = Engine(args.model_path, max_total_tokens=args.max_total_tokens, max_running_requests=64)
    tok, dtype = engine.tokenizer, engine.model_config.dtype
    per_group = max(1, int(args.per_group * args.scale))
    shared = shared_prefix_workload(tok, args.groups, per_group, args.system_len, args.question_len)
    unrelated = random_workload(tok, max(1, int(args.random_n * args.scale)), args.random_len)
    # On a thread of its own: a thread that has run a parallel op keeps an OpenMP team, which would
    # slow the engine thread's forwards for the rest of the run (see cpu_runtime).
    res["gemm_peak_gflops"] = on_short_lived_thread(gemm_peak, dtype) / 1e9
    print(f"bf16 GEMM peak: {res['gemm_peak_gflops']:.1f} GFLOP/s ({dtype})", flush=True)

    nonembed = sum(
        p.numel()
        for n, p in engine.core.runner.model.named_parameters()
        if "embed" not in n and "lm_head" not in n
    )
    rate = prefill_rate(engine, tok, max(4, int(16 * args.scale)), 512)
    res["prefill_tok_s"] = rate
    res["prefill_gflops"] = 2 * nonembed * rate / 1e9
    res["prefill_fraction_of_peak"] = res["prefill_gflops"] / res["gemm_peak_gflops"]
    print(
        f"prefill: {rate:.0f} tok/s = {res['prefill_gflops']:.1f} GFLOP/s "
        f"= {100 * res['prefill_fraction_of_peak']:.1f}% of peak",
        flush=True,
    )

    res["engine_shared"] = run_engine(engine, shared, args.output_len)
    print("engine shared-prefix:", res["engine_shared"], flush=True)
    res["engine_random"] = run_engine(engine, unrelated, args.output_len)
    print("engine random:", res["engine_random"], flush=True)
    decode_prompts = random_workload(tok, 16, 32, seed=3)
    res["engine_decode_b16"] = run_engine(engine, decode_prompts, 128)
    print("engine decode b16:", res["engine_decode_b16"], flush=True)
    model_dir = engine.core.model_path
    engine.shutdown()

    off = Engine(
        args.model_path,
        max_total_tokens=args.max_total_tokens,
        max_running_requests=64,
        disable_radix_cache=True,
    )
    res["nocache_shared"] = run_engine(off, shared, args.output_len)
    print("no-cache shared-prefix:", res["nocache_shared"], flush=True)
    res["nocache_random"] = run_engine(off, unrelated, args.output_len)
    print("no-cache random:", res["nocache_random"], flush=True)
    off.shutdown()

    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        res["hf_shared"] = run_hf(hf, shared, args.output_len, args.hf_batch)
        print("HF shared-prefix:", res["hf_shared"], flush=True)
        res["hf_random"] = run_hf(hf, unrelated, args.output_len, args.hf_batch)
        print("HF random:", res["hf_random"], flush=True)
        res["hf_decode_b16"] = run_hf(hf, decode_prompts, 128, 16)
        print("HF decode b16:", res["hf_decode_b16"], flush=True)

    ratios = {
        "shared_prefix_vs_no_cache": res["engine_shared"]["total_tok_s"]
        / res["nocache_shared"]["total_tok_s"],
        "random_vs_no_cache": res["engine_random"]["total_tok_s"] / res["nocache_random"]["total_tok_s"],
    }
    if not args.skip_hf:
        ratios["shared_prefix_vs_hf"] = res["engine_shared"]["total_tok_s"] / res["hf_shared"]["total_tok_s"]
        ratios["random_vs_hf"] = res["engine_random"]["total_tok_s"] / res["hf_random"]["total_tok_s"]
        ratios["decode_b16_vs_hf"] = (
            res["engine_decode_b16"]["output_tok_s"] / res["hf_decode_b16"]["output_tok_s"]
        )
    res["ratios"] = ratios
    print("\n== summary ==")
    print(
        f"GEMM peak {res['gemm_peak_gflops']:.1f} GFLOP/s; prefill {res['prefill_tok_s']:.0f} tok/s "
        f"= {100 * res['prefill_fraction_of_peak']:.1f}% of peak"
    )
    for k, v in ratios.items():
        print(f"{k:>28}: {v:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
