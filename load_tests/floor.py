"""The machine's floor for a serving workload: how fast any server could be on this host.

Two measured rates bound every server: the GEMM rate (the best of float32 and bfloat16 matmuls
on all cores) for the prompt tokens that must be computed, and the memory bandwidth for the
weights each decode step reads. The floor of a run is

    prompt:  each request's uncached tokens over its cached prefix (projections, causal
             attention, the LM head of the last), at the GEMM rate
    decode:  per step, the larger of (its bytes: the weights and the batch's KV / bandwidth) and
             (its FLOPs / GEMM rate), for (output tokens / batch) steps at the workload's
             concurrency

where the uncached tokens are those that no cache can save: each request's prompt less what the
server that reused the most reported cached for it (the counts are load_tests/gpu_model.py's `Shape`, as
the GPU benchmark's). It is a lower bound (perfect overlap, no bookkeeping, every
batch full), which is what makes "x times the floor" a fair yardstick across servers.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from load_tests.gpu_model import Shape


@dataclass(frozen=True)
class Machine:
    gemm_flops: float  # FLOP/s, the best dtype
    gemm_dtype: str
    bandwidth: float  # bytes/s read from memory


def load_shape(model: str | None) -> Shape:
    """The served model's shape, read as RadixServe's loader reads it: an HF directory, a GGUF
    file, or None for the default model."""
    from radixserve.workers.models.loader import read_config, resolve_model_dir

    model_dir = Path(model) if model and Path(model, "config.json").is_file() else resolve_model_dir(model)[0]
    c = read_config(model_dir, torch.float32)
    if c.head_dim * c.num_heads != c.hidden_size:
        raise ValueError(
            f"the floor assumes head_dim x heads = hidden; {model_dir} has {c.head_dim} x {c.num_heads}"
        )
    return Shape(c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.intermediate_size, c.vocab_size)


def measure_machine(seconds: float = 1.0) -> Machine:
    torch.set_num_threads(os.cpu_count() or 1)
    best, best_dtype = 0.0, ""
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(512, 2048, dtype=dtype)
        b = torch.randn(2048, 2048, dtype=dtype)
        rate = 2 * 512 * 2048 * 2048 / _timed(lambda a=a, b=b: torch.mm(a, b), seconds)
        if rate > best:
            best, best_dtype = rate, str(dtype).removeprefix("torch.")
    x = torch.ones(128 * 2**20, dtype=torch.float32)  # 512 MiB: far past every cache
    bandwidth = x.numel() * 4 / _timed(lambda: x.sum(), seconds)
    return Machine(best, best_dtype, bandwidth)


def _timed(fn, seconds: float) -> float:
    """Best time of one call over about `seconds` of calls."""
    fn()
    best, spent = math.inf, 0.0
    while spent < seconds:
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best, spent = min(best, dt), spent + dt
    return best


def workload_floor(
    machine: Machine,
    shape: Shape,
    requests: list[dict[str, int]],
    concurrency: int,
    bytes_per_weight: float,
) -> dict[str, float]:
    """`requests`: each one's prompt tokens, cached tokens (the fewest any server computed) and
    output tokens. Returns the floor's parts in seconds and the quantities behind them."""
    computed = sum(r["prompt"] - r["cached"] for r in requests)
    prompt_flops = sum(shape.prefill_flops(1, r["prompt"] - r["cached"], r["cached"]) for r in requests)
    prefill_s = prompt_flops / machine.gemm_flops
    batch = max(1, min(concurrency, len(requests)))
    steps = math.ceil(sum(r["output"] for r in requests) / batch)
    # a decode step is one new token per sequence over its context (the mean one, mid-output)
    context = round(sum(r["prompt"] + r["output"] / 2 for r in requests) / max(len(requests), 1))
    step_bytes = shape.decode_bytes(batch, context, elem=bytes_per_weight)
    step_s = max(step_bytes / machine.bandwidth, shape.prefill_flops(batch, 1, context) / machine.gemm_flops)
    return {
        "prompt_tokens_computed": computed,
        "prefill_s": prefill_s,
        "decode_steps": steps,
        "decode_batch": batch,
        "decode_step_s": step_s,
        "decode_s": steps * step_s,
        "floor_s": prefill_s + steps * step_s,
    }
