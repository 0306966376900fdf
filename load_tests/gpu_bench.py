"""GPU figures for the Triton attention kernels in a Llama-3-8B-shaped forward (random bf16 weights
drawn on the GPU; torch matmuls, Triton attention over a paged pool with scattered slots), and for
the engine's own model of that shape on the GPU:

- decode at batch 1: bytes a step must move (weights + KV) / step time, against the measured
  device-to-device copy bandwidth (and the spec-sheet figure where torch reports the memory bus);
- prefill: matmul FLOPs / time (MFU) against a measured bf16 8192^3 matmul;
- the attention kernels alone: decode GB/s at batch 32, extend TFLOP/s beside torch SDPA;
- the engine's model (workers/models, what --device cuda serves): decode at batch 1 eager and from
  its CUDA graph, the prefill, each beside the plain model's figures.

Before timing, one decode step and one prefill are compared with plain torch attention over the
same pool (relative L2 difference of the logits); a difference over --max-rel-diff fails the run.

    python -m load_tests.gpu_bench                 # a GPU: about 2 minutes, 20 GB of GPU memory
    python -m load_tests.gpu_bench --dry-run       # anywhere: a 2-layer float32 model on CPU under
                                                   # Triton's interpreter; checks the code paths only
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from load_tests.gpu_model import (
    LLAMA3_8B,
    TINY,
    RandomLlama,
    Shape,
    engine_batch,
    engine_model,
    reference_attention,
    scattered_layout,
    step_inputs,
    swapped_attention,
    triton_attention,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="tiny float32 model on CPU, interpreted kernels")
    p.add_argument("--context", type=int, default=4096, help="decode: tokens already in the KV cache")
    p.add_argument("--decode-steps", type=int, default=50, help="decode steps timed")
    p.add_argument("--prefill-len", type=int, default=4096, help="prefill: new tokens per sequence")
    p.add_argument("--prefill-batch", type=int, default=1)
    p.add_argument("--prefix", type=int, default=0, help="prefill: cached tokens before the new ones")
    p.add_argument("--no-cuda-graph", action="store_true", help="time decode eagerly only")
    p.add_argument("--max-rel-diff", type=float, default=0.05, help="logits vs torch attention")
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args(argv)
    if args.dry_run:
        args.context, args.decode_steps, args.prefill_len, args.prefix = 40, 2, 24, 8
        args.max_rel_diff = min(args.max_rel_diff, 1e-4)
    return args


def timed(fn: Callable[[], Any], iters: int, device: torch.device) -> float:
    """Mean seconds per call over `iters` calls, after two warm-up calls."""
    fn()
    fn()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) / iters
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    begin.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1000 / iters


def measure_peaks(device: torch.device, dtype: torch.dtype, small: bool) -> dict[str, Any]:
    """Achievable copy bandwidth (read + write) and matmul throughput on this device."""
    nbytes = (64 << 20) if small else (2 << 30)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src), 3 if small else 20, device)
    n = 256 if small else 8192
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    mm_s = timed(lambda: a @ b, 3 if small else 20, device)
    peaks: dict[str, Any] = {"copy_GBps": 2 * nbytes / copy_s / 1e9, "matmul_TFLOPs": 2 * n**3 / mm_s / 1e12}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        peaks["device"] = props.name
        clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
        if clock_khz and bus_bits:  # double data rate
            peaks["spec_GBps"] = 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9
    return peaks


def check_logits(model: RandomLlama, layout, limit: float) -> float:
    """Relative L2 difference of one step's logits, Triton vs torch attention. The step rewrites the
    new tokens' K/V with the same values each time, so it can be repeated."""
    inputs = step_inputs(layout)
    ours = model.forward(**inputs, attention=triton_attention(model, layout))
    ref = model.forward(**inputs, attention=reference_attention(model, layout))
    return _rel_diff(ours, ref, limit, "torch attention's")


def bench_decode(model: RandomLlama, args, device: torch.device) -> dict[str, Any]:
    layout = scattered_layout(1, args.context, 1, model.k_buffers[0].shape[0], device)
    out: dict[str, Any] = {
        "batch": 1,
        "context": args.context,
        "rel_diff": check_logits(model, layout, args.max_rel_diff),
    }
    inputs, attention = step_inputs(layout), triton_attention(model, layout)
    step = lambda: model.forward(**inputs, attention=attention)
    nbytes = model.shape.decode_bytes(1, args.context, model.k_buffers[0].element_size())
    out["bytes_per_step"] = nbytes
    out["eager_ms"] = timed(step, args.decode_steps, device) * 1e3
    if device.type == "cuda" and not args.no_cuda_graph:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # compile and warm up outside the capture
            step()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        out["graph_ms"] = timed(graph.replay, args.decode_steps, device) * 1e3
    best_ms = min(out.get("graph_ms", out["eager_ms"]), out["eager_ms"])
    out["GBps"] = nbytes / (best_ms / 1e3) / 1e9
    return out


def bench_prefill(model: RandomLlama, args, device: torch.device) -> dict[str, Any]:
    batch, new, prefix = args.prefill_batch, args.prefill_len, args.prefix
    layout = scattered_layout(batch, prefix, new, model.k_buffers[0].shape[0], device, seed=1)
    out: dict[str, Any] = {"batch": batch, "new_tokens": new, "prefix": prefix}
    out["rel_diff"] = check_logits(model, layout, args.max_rel_diff)
    inputs, attention = step_inputs(layout), triton_attention(model, layout)
    seconds = timed(lambda: model.forward(**inputs, attention=attention), 3 if args.dry_run else 5, device)
    out["ms"] = seconds * 1e3
    out["TFLOPs"] = model.shape.prefill_flops(batch, new, prefix) / seconds / 1e12
    return out


def bench_attention_kernels(shape: Shape, args, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """One layer's attention alone: decode over many long sequences, a causal prefill."""
    from radixserve.kernels.triton_ops import decode_attention, extend_attention
    from radixserve.kernels.varlen_attention import extend_attention_varlen

    batch, context = (2, args.context) if args.dry_run else (32, args.context)
    slots = batch * (context + 1)
    k_buf = torch.randn(slots, shape.kv_heads, shape.head_dim, device=device, dtype=dtype)
    v_buf = torch.randn_like(k_buf)
    layout = scattered_layout(batch, context, 1, slots, device)
    q = torch.randn(batch, shape.heads, shape.head_dim, device=device, dtype=dtype)
    iters = 2 if args.dry_run else 20
    t = timed(lambda: decode_attention(q, k_buf, v_buf, layout.kv_indices, layout.seq_lens), iters, device)
    kv_bytes = batch * (context + 1) * 2 * shape.kv_heads * shape.head_dim * k_buf.element_size()
    out: dict[str, Any] = {
        "decode_batch": batch,
        "decode_context": context,
        "decode_GBps": kv_bytes / t / 1e9,
    }
    new = args.prefill_len
    layout = scattered_layout(1, 0, new, slots, device)
    q = torch.randn(new, shape.heads, shape.head_dim, device=device, dtype=dtype)
    cu = torch.tensor([0, new], device=device)
    flops = 4 * shape.heads * shape.head_dim * new * (new + 1) // 2
    args_ = (q, k_buf, v_buf, layout.kv_indices)
    t = timed(lambda: extend_attention(*args_, layout.seq_lens, cu, new), iters, device)
    out.update(extend_tokens=new, extend_TFLOPs=flops / t / 1e12)
    t = timed(lambda: extend_attention_varlen(*args_, [new], [new], use_flash=False), iters, device)
    out["sdpa_TFLOPs"] = flops / t / 1e12
    return out


def bench_engine(shape: Shape, args, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """The engine's own model on the device (what --device cuda serves): decode at batch 1 eagerly
    and replayed from its CUDA graph (executor/cuda_graphs.py), and the prefill. Its logits are
    checked against the torch attention backend's, and the graph's against eager decode."""
    from radixserve.workers.executor.cuda_graphs import DecodeGraphs
    from radixserve.workers.models.attention import TorchBackend

    slots = max(args.context + 1, args.prefill_batch * (args.prefix + args.prefill_len))
    model, pool = engine_model(shape, slots, device, dtype)
    out: dict[str, Any] = {"backend": model.backend.name}
    decode = engine_batch(scattered_layout(1, args.context, 1, slots, device))

    def with_torch_attention(batch) -> torch.Tensor:
        with swapped_attention(model, TorchBackend()):
            return model(batch, pool)

    eager = model(decode, pool)
    out["decode_rel_diff"] = _rel_diff(
        eager, with_torch_attention(decode), args.max_rel_diff, "the torch backend's"
    )
    out["decode_eager_ms"] = timed(lambda: model(decode, pool), args.decode_steps, device) * 1e3
    graphs = DecodeGraphs(model, pool, 1, args.context + 1, device)
    if device.type == "cuda" and not args.no_cuda_graph:
        graphs.capture()
    else:  # the same buffers and replay path, without graphs
        graphs.run_eagerly()
    out["graph_rel_diff"] = _rel_diff(graphs.run(decode).clone(), eager, 1e-3, "eager decode's")
    if graphs.graphs:
        out["decode_graph_ms"] = timed(lambda: graphs.run(decode), args.decode_steps, device) * 1e3
    best_ms = min(out["decode_eager_ms"], out.get("decode_graph_ms", out["decode_eager_ms"]))
    out["decode_GBps"] = (
        shape.decode_bytes(1, args.context, pool.k_buffers[0].element_size()) / best_ms * 1e3 / 1e9
    )
    prefill = engine_batch(
        scattered_layout(args.prefill_batch, args.prefix, args.prefill_len, slots, device, 1)
    )
    out["prefill_rel_diff"] = _rel_diff(
        model(prefill, pool), with_torch_attention(prefill), args.max_rel_diff, "the torch backend's"
    )
    seconds = timed(lambda: model(prefill, pool), 3 if args.dry_run else 5, device)
    out["prefill_ms"] = seconds * 1e3
    out["prefill_TFLOPs"] = (
        shape.prefill_flops(args.prefill_batch, args.prefill_len, args.prefix) / seconds / 1e12
    )
    return out


def _rel_diff(ours: torch.Tensor, ref: torch.Tensor, limit: float, what: str) -> float:
    """Relative L2 difference of `ours` from `ref` (`what`, for the error), checked against `limit`."""
    diff = ((ours - ref).norm() / ref.norm()).item()
    if not (torch.isfinite(ours).all() and diff <= limit):
        raise AssertionError(f"logits differ from {what} by {diff:.3g} (limit {limit})")
    return diff


def headline(figures: dict[str, Any]) -> dict[str, Any]:
    """The engine model's figures that load_tests/gpu_check.sh reports: decode at batch 1 as a share
    of HBM bandwidth (the spec sheet's where torch reports the memory bus, else the measured copy),
    prefill MFU against the measured matmul, and the decode CUDA graph's speed-up (None without)."""
    peaks, eng = figures["peaks"], figures["engine"]
    spec = "spec_GBps" in peaks
    graph_ms = eng.get("decode_graph_ms")
    return {
        "decode_hbm_share_batch1": eng["decode_GBps"] / peaks["spec_GBps" if spec else "copy_GBps"],
        "decode_hbm_basis": "spec-sheet bandwidth" if spec else "measured copy bandwidth",
        "prefill_mfu": eng["prefill_TFLOPs"] / peaks["matmul_TFLOPs"],
        "prefill_mfu_basis": f"measured {figures['dtype']} matmul",
        "cuda_graph_decode_speedup": eng["decode_eager_ms"] / graph_ms if graph_ms else None,
    }


def report(figures: dict[str, Any]) -> str:
    peaks, dec, pre, ker = figures["peaks"], figures["decode"], figures["prefill"], figures["kernels"]
    copy_bw = peaks["copy_GBps"]
    lines = [
        f"device: {peaks.get('device', figures['device'])}  shape: {figures['shape']}",
        f"peaks: copy {copy_bw:.0f} GB/s"
        + (f" (spec {peaks['spec_GBps']:.0f} GB/s)" if "spec_GBps" in peaks else "")
        + f", {figures['dtype']} matmul {peaks['matmul_TFLOPs']:.1f} TFLOP/s",
        f"decode batch 1, context {dec['context']}: eager {dec['eager_ms']:.2f} ms"
        + (f", CUDA graph {dec['graph_ms']:.2f} ms" if "graph_ms" in dec else "")
        + f" -> {dec['GBps']:.0f} GB/s = {100 * dec['GBps'] / copy_bw:.1f}% of copy bandwidth"
        + (f", {100 * dec['GBps'] / peaks['spec_GBps']:.1f}% of spec" if "spec_GBps" in peaks else ""),
        f"prefill {pre['batch']} x {pre['new_tokens']} (prefix {pre['prefix']}): {pre['ms']:.1f} ms -> "
        f"{pre['TFLOPs']:.1f} TFLOP/s = {100 * pre['TFLOPs'] / peaks['matmul_TFLOPs']:.1f}% MFU of measured matmul",
        f"attention alone: decode {ker['decode_batch']} x {ker['decode_context']}: {ker['decode_GBps']:.0f} GB/s "
        f"({100 * ker['decode_GBps'] / copy_bw:.1f}% of copy); extend {ker['extend_tokens']} causal: "
        f"Triton {ker['extend_TFLOPs']:.1f} TFLOP/s, SDPA {ker['sdpa_TFLOPs']:.1f} TFLOP/s",
        f"logits vs torch attention (rel. L2): decode {dec['rel_diff']:.2e}, prefill {pre['rel_diff']:.2e}",
    ]
    eng = figures.get("engine")
    if eng:
        graph = eng.get("decode_graph_ms")
        lines += [
            f"engine ({eng['backend']} attention) decode batch 1: eager {eng['decode_eager_ms']:.2f} ms"
            + (f", CUDA graph {graph:.2f} ms ({eng['decode_eager_ms'] / graph:.2f}x)" if graph else "")
            + f" -> {eng['decode_GBps']:.0f} GB/s = {100 * eng['decode_GBps'] / copy_bw:.1f}% of copy bandwidth, "
            f"{eng['decode_GBps'] / dec['GBps']:.2f}x the plain model's",
            f"engine prefill: {eng['prefill_ms']:.1f} ms -> {eng['prefill_TFLOPs']:.1f} TFLOP/s = "
            f"{100 * eng['prefill_TFLOPs'] / peaks['matmul_TFLOPs']:.1f}% MFU, "
            f"{eng['prefill_TFLOPs'] / pre['TFLOPs']:.2f}x the plain model's",
            f"engine logits vs its torch attention backend (rel. L2): decode {eng['decode_rel_diff']:.2e}, "
            f"prefill {eng['prefill_rel_diff']:.2e}; CUDA graph vs eager {eng['graph_rel_diff']:.2e}",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        device, shape, dtype = torch.device("cpu"), TINY, torch.float32
    elif not torch.cuda.is_available():
        print(
            "gpu_bench: no CUDA GPU visible; nothing measured (--dry-run checks the code paths on CPU)",
            file=sys.stderr,
        )
        return 2
    else:
        device, shape, dtype = torch.device("cuda"), LLAMA3_8B, torch.bfloat16
    torch.manual_seed(0)
    figures: dict[str, Any] = {"device": str(device), "shape": "tiny" if args.dry_run else "llama3-8b"}
    figures["dtype"] = str(dtype).removeprefix("torch.")
    figures["peaks"] = measure_peaks(device, dtype, small=args.dry_run)
    slots = max(args.context + 1, args.prefill_batch * (args.prefix + args.prefill_len))
    model = RandomLlama(shape, slots, str(device), dtype=dtype)
    figures["decode"] = bench_decode(model, args, device)
    figures["prefill"] = bench_prefill(model, args, device)
    del model
    figures["kernels"] = bench_attention_kernels(shape, args, device, dtype)
    figures["engine"] = bench_engine(shape, args, device, dtype)
    figures["headline"] = headline(figures)
    print(report(figures))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
