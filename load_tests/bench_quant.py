"""Quantized weights against the unquantized model, side by side in one run on one model
(default: the embedded SmolLM2-135M-Instruct): weight memory, decode tokens per second at batch 1
and 16, perplexity over a fixed text (the first --ppl-tokens tokens of the Python distribution's
pydoc_data/topics.py, the reference manual's topics that ship with it, scored in windows of
--window tokens), and greedy agreement (the share of 64 fixed prompts whose 32 greedy tokens equal
the reference's, and the mean matched-prefix length). The reference is the model in its dtype;
for a GGUF model that is the file dequantized, so `gguf` is compared with the same weights.
Decode rates are medians of --rounds rounds in which the models take turns.

    python -m load_tests.bench_quant [--model PATH] [--dtype auto] [--quantization int8,gguf,gguf:int8]
    python -m load_tests.bench_quant --dtype bfloat16 --quantization kv-int8 --context 2000  # int8 KV
    python -m load_tests.bench_quant --crossover   # fused kernels vs dequantize + GEMM, per rows
    python -m load_tests.bench_quant --strips-crossover   # bf16 rows: row layout, strips, GEMMs
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from radixserve.kernels import cpu_ops, quant_ops
from radixserve.kernels.quant_ops import QuantTensor
from radixserve.workers.batch_kind import BatchKind
from radixserve.workers.mem_cache.kv_pool import KVPool
from radixserve.workers.models.forward_batch import ForwardBatch
from radixserve.workers.models.loader import LoadedModel, load_model
from radixserve.workers.models.quant_weight import weight_nbytes


def batch_of(
    kind: BatchKind, tokens: list[list[int]], starts: list[int], slots: list[list[int]], all_rows=False
):
    ext = [len(t) for t in tokens]
    seq = [s + e for s, e in zip(starts, ext)]
    kv = torch.zeros(len(tokens), max(seq), dtype=torch.int64)
    for i, s in enumerate(slots):
        kv[i, : seq[i]] = torch.tensor(s[: seq[i]])
    ends = torch.tensor(ext).cumsum(0)
    return ForwardBatch(
        kind=kind,
        input_ids=torch.tensor([t for ts in tokens for t in ts], dtype=torch.int64),
        positions=torch.tensor([s + j for s, e in zip(starts, ext) for j in range(e)], dtype=torch.int64),
        out_slots=torch.tensor(
            [sl[s + j] for sl, s, e in zip(slots, starts, ext) for j in range(e)], dtype=torch.int64
        ),
        seq_lens=torch.tensor(seq, dtype=torch.int64),
        extend_lens=torch.tensor(ext, dtype=torch.int64),
        kv_indices=kv,
        logits_indices=torch.arange(int(ends[-1])) if all_rows else ends - 1,
        seq_lens_list=seq,
        extend_lens_list=ext,
    )


class Runner:
    def __init__(self, loaded: LoadedModel, slots: int = 8192, kv_dtype: torch.dtype | None = None):
        c = loaded.config
        self.model = loaded.model
        self.pool = KVPool(c.num_layers, loaded.local_kv_heads, c.head_dim, slots, dtype=kv_dtype or c.dtype)

    def greedy(self, prompts: list[list[int]], new: int) -> tuple[list[list[int]], float]:
        """Greedy tokens of every prompt (batched), and decode tokens per second."""
        slots = [self.pool.alloc(len(p) + new) for p in prompts]
        out = self.model(batch_of(BatchKind.PREFILL, prompts, [0] * len(prompts), slots), self.pool)
        tokens = [[int(t)] for t in out.argmax(-1)]
        start = time.perf_counter()
        for step in range(1, new):
            lens = [len(p) + step - 1 for p in prompts]
            batch = batch_of(BatchKind.DECODE, [[t[-1]] for t in tokens], lens, slots)
            for t, n in zip(tokens, self.model(batch, self.pool).argmax(-1).tolist()):
                t.append(int(n))
        rate = len(prompts) * (new - 1) / (time.perf_counter() - start)
        for s in slots:
            self.pool.free(s)
        return tokens, rate

    def perplexity(self, ids: list[int], window: int) -> float:
        nll, count = 0.0, 0
        for lo in range(0, len(ids) - 1, window):
            piece = ids[lo : lo + window + 1]
            slots = self.pool.alloc(len(piece) - 1)
            logits = self.model(batch_of(BatchKind.PREFILL, [piece[:-1]], [0], [slots], True), self.pool)
            self.pool.free(slots)
            nll += F.cross_entropy(logits.float(), torch.tensor(piece[1:]), reduction="sum").item()
            count += len(piece) - 1
        return math.exp(nll / count)


def fixed_text() -> str:
    import pydoc_data.topics

    return Path(pydoc_data.topics.__file__).read_text()[:200_000]


def measure(runners: dict[str, Runner], prompts: list[list[int]], args) -> dict[str, dict]:
    """Decode tokens per second at batch 1 and 16, the models taking turns round after round (the
    host's speed drifts: every model sees the same drift), median of --rounds. The prompts are
    --context tokens long (the KV each decode step reads)."""
    for r in runners.values():
        r.greedy(prompts[:1], 4)  # warm-up
    rates: dict[str, dict[str, list[float]]] = {name: {"b1": [], "b16": []} for name in runners}
    for _ in range(args.rounds):
        for name, r in runners.items():
            rates[name]["b1"].append(r.greedy(prompts[:1], args.decode_tokens)[1])
            rates[name]["b16"].append(r.greedy(prompts[:16], args.decode_tokens)[1])
    return {name: {k: statistics.median(v) for k, v in by.items()} for name, by in rates.items()}


def crossover() -> None:
    """The fused kernel against dequantize + torch's GEMM per row count, on the default model's
    shapes, for the two layouts the default model uses (Q4_1: 4 bits, group 32, float16 scale and
    offset; per-channel int8)."""
    if cpu_ops.native_ops() is None:
        raise SystemExit("the crossover needs the CPU extension")
    for n, k in ((960, 576), (3072, 576), (576, 1536)):
        w = torch.randn(n, k)
        layouts = {
            "q4 g32": QuantTensor(
                quant_ops.pack_int4(torch.randint(0, 16, (n, k), dtype=torch.uint8)),
                torch.rand(n, k // 32).half(),
                torch.rand(n, k // 32).half(),
                32,
                4,
            ),
            "int8": quant_ops.quantize_int8(w),
        }
        for label, qt in layouts.items():
            for rows in (1, 2, 4, 8, 16, 32, 64):
                x = torch.randn(rows, k)
                times = []
                for below in (sys.maxsize, 0):  # every row count fused, then none
                    qt.linear(x, None, below)
                    t0 = time.perf_counter()
                    for _ in range(50):
                        qt.linear(x, None, below)
                    times.append((time.perf_counter() - t0) * 2e4)
                F.linear(x, w)
                t0 = time.perf_counter()
                for _ in range(50):
                    F.linear(x, w)
                times.append((time.perf_counter() - t0) * 2e4)
                print(
                    f"N={n} K={k} {label:7s} rows={rows:3d}: fused {times[0]:7.0f} us  "
                    f"dequant+gemm {times[1]:7.0f} us  float32 gemm {times[2]:7.0f} us"
                )


def strips_crossover(rounds: int = 20) -> None:
    """bf16 rows of x on an AVX512-BF16 CPU: the row-layout kernel, the strip kernel
    (quant_ops.StripTensor), with int8 activations (AVX-512 VNNI), the strips dequantized + torch's
    GEMM, and the packed bf16 GEMM on the
    dequantized weight, per row count, on the default model's projection shapes (Q4_1: 4 bits,
    group 32, float16 scale and offset; the LM head Q8_0). Best of `rounds`; where the strips meet
    dequantize + GEMM sets quant_ops.STRIP_DEQUANT_ROWS."""
    ops = cpu_ops.native_ops()
    if not quant_ops.strips_available() or not cpu_ops.gemm_available(torch.bfloat16, torch.device("cpu")):
        raise SystemExit("the strips need the CPU extension on an AVX512-BF16 CPU")
    g = torch.Generator().manual_seed(0)
    int8 = quant_ops.strips_int8_available()

    def q4(n: int, k: int) -> QuantTensor:
        values = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        scale = (torch.rand(n, k // 32, generator=g) * 0.01).half()
        return QuantTensor(quant_ops.pack_int4(values), scale, -8 * scale, 32, 4)

    def q8(n: int, k: int) -> QuantTensor:
        values = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        return QuantTensor(values, (torch.rand(n, k // 32, generator=g) * 0.01).half(), None, 32, 8)

    shapes = {
        "qkv q4": q4(960, 576),
        "gate_up q4": q4(3072, 576),
        "down q4": q4(576, 1536),
        "head q8": q8(49152, 576),
    }

    def best(f, *args) -> float:
        f(*args)
        out = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            f(*args)
            out.append(time.perf_counter() - t0)
        return min(out) * 1e6

    def dequant_gemm(x: torch.Tensor, strips: quant_ops.StripTensor) -> torch.Tensor:
        return F.linear(x, strips.dequantize(torch.bfloat16))

    for label, qt in shapes.items():
        strips = quant_ops.StripTensor.pack(qt)
        packed = cpu_ops.pack_linear_weight(qt.dequantize(torch.bfloat16))
        for rows in (1, 4, 16, 64, 128, 192, 256, 512):
            x = torch.randn(rows, qt.k, generator=g).to(torch.bfloat16)
            args = (strips.data, strips.scale, strips.offset, strips.n, strips.group, strips.bits, None)
            times = [
                best(qt.linear, x, None, sys.maxsize),  # the row layout's kernel
                best(ops.quant_strip_linear, x, *args),
                best(ops.quant_strip_linear, x, *args, int8) if int8 else float("nan"),
                best(dequant_gemm, x, strips),
                best(ops.packed_linear, x, packed, qt.n, None),
            ]
            print(
                f"{label:10s} N={qt.n:5d} K={qt.k:4d} rows={rows:3d}: rows {times[0]:8.0f} us  "
                f"strips {times[1]:8.0f} us  strips int8 x {times[2]:8.0f} us  "
                f"dequant+gemm {times[3]:8.0f} us  packed bf16 {times[4]:8.0f} us"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument(
        "--quantization",
        default="int8,gguf,gguf:int8",
        help="comma-separated: int8, fp8 (GPU), gguf; with :int8 for int8 activations (gguf:int8); "
        "kv-int8: the reference's weights over an int8 KV cache (kv_cache_dtype int8)",
    )
    p.add_argument("--ppl-tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--context", type=int, default=16, help="prompt tokens of the decode-rate prompts")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--crossover", action="store_true")
    p.add_argument("--strips-crossover", action="store_true")
    args = p.parse_args()
    if args.crossover:
        return crossover()
    if args.strips_crossover:
        return strips_crossover()
    modes = ["none", *args.quantization.split(",")]
    loaded = {}
    for m in modes:  # "gguf:int8" = quantization gguf with int8 activations; "kv-int8": int8 KV
        quantization, _, acts = m.partition(":")
        if m == "kv-int8":
            loaded[m] = loaded.get("none") or load_model(args.model, args.dtype, quantization="none")
            continue
        loaded[m] = load_model(
            args.model, args.dtype, quantization=quantization, quantized_activations=acts or "float"
        )
    ref = loaded["none"]
    ids = ref.tokenizer(fixed_text())["input_ids"]
    text_ids, rest = ids[: args.ppl_tokens], ids[args.ppl_tokens :]
    prompts = [rest[16 * i : 16 * i + 16] for i in range(64)]
    slots = max(8192, 16 * (args.context + args.decode_tokens) + 64)
    runners = {
        m: Runner(lm, slots, kv_dtype=torch.int8 if m == "kv-int8" else None) for m, lm in loaded.items()
    }
    long_prompts = [(ids * (1 + args.context // len(ids)))[i * 97 : i * 97 + args.context] for i in range(16)]
    rates = measure(runners, prompts if args.context <= 16 else long_prompts, args)
    result = {}
    for m, r in runners.items():
        result[m] = {
            "bytes": weight_nbytes(r.model),
            **rates[m],
            "ppl": r.perplexity(text_ids, args.window),
            "tokens": r.greedy(prompts, 32)[0],
        }
    base = result["none"]
    # The checkpoint's weights in bf16: a tied LM head is the embedding's table (the reference
    # holds a packed copy of it for the GEMM, which is no weight of the checkpoint).
    weights = sum(p.numel() for n, p in ref.model.named_parameters() if not n.startswith("lm_head."))
    if not ref.config.tie_word_embeddings:
        weights += sum(p.numel() for n, p in ref.model.named_parameters() if n.startswith("lm_head."))
    bf16_bytes = weights * 2
    print(f"reference: the model in {ref.config.dtype} (dequantized from the file for a GGUF model)")
    print(f"{'':16s}" + "".join(f"{m:>12s}{'ratio':>8s}" for m in modes))
    rows = [
        ("weights MB", "bytes", 1e-6),
        ("decode b1 t/s", "b1", 1),
        ("decode b16 t/s", "b16", 1),
        ("perplexity", "ppl", 1),
    ]
    for label, key, unit in rows:
        cells = "".join(f"{result[m][key] * unit:12.2f}{result[m][key] / base[key]:8.3f}" for m in modes)
        print(f"{label:16s}{cells}")
    print(f"{'weights vs bf16':16s}" + "".join(f"{result[m]['bytes'] / bf16_bytes:20.3f}" for m in modes))
    for m in modes[1:]:
        quant = result[m]
        same = sum(a == b for a, b in zip(quant["tokens"], base["tokens"]))
        prefix = [
            next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), 32)
            for a, b in zip(quant["tokens"], base["tokens"])
        ]
        print(
            f"{m}: greedy agreement {same}/64 prompts identical over 32 tokens, mean matched prefix {sum(prefix) / 64:.1f}"
        )


if __name__ == "__main__":
    main()
