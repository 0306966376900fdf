"""The machine's floor for a serving workload: how fast any server could be on this host.

Two measured rates bound every server: the GEMM rate (the best of float32 and bfloat16 matmuls
on all cores) for the prompt tokens that must be computed, and the memory bandwidth for the
weights each decode step reads. The floor of a run is

    prompt:  (tokens computed) x 2 x (decoder weights) + attention, at the GEMM rate
    decode:  per step, the larger of (weight bytes / bandwidth) and (its FLOPs / GEMM rate),
             for (output tokens / batch) steps at the workload's concurrency

where "tokens computed" is the prompt tokens that no cache can save: the total less the most any
server measured reported as cached. It is a lower bound (perfect overlap, no bookkeeping, every
batch full), which is what makes "x times the floor" a fair yardstick across servers.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Machine:
    gemm_flops: float  # FLOP/s, the best dtype
    gemm_dtype: str
    bandwidth: float  # bytes/s read from memory


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @property
    def layer_weights(self) -> int:
        """Weights of one decoder layer's projections (q, k, v, o, gate, up, down)."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        return h * self.heads * self.head_dim * 2 + 2 * h * kv + 3 * h * self.intermediate

    @property
    def decoder_weights(self) -> int:
        return self.layers * self.layer_weights

    @property
    def head_weights(self) -> int:
        return self.vocab * self.hidden

    def attention_flops(self, start: int, end: int) -> float:
        """Scores and the weighted sum for positions start..end-1, each over its whole prefix."""
        positions = (start + end + 1) * (end - start) / 2  # sum of context lengths
        return 4.0 * self.layers * self.heads * self.head_dim * positions


def load_shape(model: str | None) -> ModelShape:
    """The served model's shape, read as RadixServe's loader reads it: an HF directory, a GGUF
    file, or None for the default model."""
    import torch

    from radixserve.workers.models.loader import read_config, resolve_model_dir

    model_dir = Path(model) if model and Path(model, "config.json").is_file() else resolve_model_dir(model)[0]
    c = read_config(model_dir, torch.float32)
    return ModelShape(
        layers=c.num_layers,
        hidden=c.hidden_size,
        heads=c.num_heads,
        kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        intermediate=c.intermediate_size,
        vocab=c.vocab_size,
    )


def measure_machine(seconds: float = 1.0) -> Machine:
    import torch

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
    shape: ModelShape,
    requests: list[dict[str, int]],
    concurrency: int,
    bytes_per_weight: float,
) -> dict[str, float]:
    """`requests`: each one's prompt tokens, cached tokens (the fewest any server computed) and
    output tokens. Returns the floor's parts in seconds and the quantities behind them."""
    computed = sum(r["prompt"] - r["cached"] for r in requests)
    prompt_flops = computed * 2.0 * shape.decoder_weights + len(requests) * 2.0 * shape.head_weights
    prompt_flops += sum(shape.attention_flops(r["cached"], r["prompt"]) for r in requests)
    prefill_s = prompt_flops / machine.gemm_flops
    batch = max(1, min(concurrency, len(requests)))
    outputs = sum(r["output"] for r in requests)
    steps = math.ceil(outputs / batch)
    mean_ctx = sum(r["prompt"] + r["output"] / 2 for r in requests) / max(len(requests), 1)
    weights = shape.decoder_weights + shape.head_weights
    step_flops = batch * (2.0 * weights + 4.0 * shape.layers * shape.heads * shape.head_dim * mean_ctx)
    step_s = max(weights * bytes_per_weight / machine.bandwidth, step_flops / machine.gemm_flops)
    return {
        "prompt_tokens_computed": computed,
        "prefill_s": prefill_s,
        "decode_steps": steps,
        "decode_batch": batch,
        "decode_step_s": step_s,
        "decode_s": steps * step_s,
        "floor_s": prefill_s + steps * step_s,
    }
