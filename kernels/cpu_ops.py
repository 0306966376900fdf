"""Fused CPU ops (csrc/*.cpp) with plain-torch fallbacks that compute the same thing.

The C++ extension is compiled at first use with torch.utils.cpp_extension (g++ and ninja needed)
into torch's extension cache ($TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions), one
build per source, CPU feature set, torch and Python version. Where it cannot be built
(no compiler) or RADIXSERVE_CPU_KERNELS=0, every op runs its torch fallback: slower, same results
up to float rounding. `native_ops()` says which one is in use.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

# Resolved: the same sources reached through a symlinked package (gpu_check.sh's build/lint) must not
# read as other files to the build, which would then compile them again over the same name.
_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCE = _CSRC / "cpu_ops.cpp"  # includes the other files of csrc/
# -fno-trapping-math lets float->int conversions (the exp polynomial) vectorize; results unchanged.
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-trapping-math", "-fno-math-errno"]


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


@functools.lru_cache(maxsize=1)
def native_ops() -> Any:  # the extension module, or None
    """The compiled extension module, or None when disabled or unbuildable."""
    if os.environ.get("RADIXSERVE_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        # -march=native code must never run on another CPU: the CPU's flags are part of the name,
        # and so are torch's and Python's versions (two environments sharing the cache would
        # otherwise rebuild one name over each other's build).
        key = hashlib.sha256(" ".join(_FLAGS).encode() + _cpu_signature().encode())
        key.update(f"{torch.__version__} {sys.version_info[:2]}".encode())
        for path in sorted(_CSRC.iterdir()):
            key.update(path.read_bytes())
        name = f"radixserve_cpu_ops_{key.hexdigest()[:12]}"
        build = _build_directory(name)
        with _exclusive(build):
            return load(
                name=name,
                sources=[str(_SOURCE)],
                extra_cflags=_FLAGS,
                extra_ldflags=["-fopenmp"],
                build_directory=str(build),
                verbose=False,
            )
    except Exception as exc:  # no compiler, no headers, ...: the torch fallbacks still work
        log.warning("RadixServe CPU kernels unavailable, using torch fallbacks: %s", exc)
        return None


def extensions_dir() -> Path:
    """Where the kernels are built: torch's extension cache."""
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")


def _build_directory(name: str) -> Path:
    build = extensions_dir() / name
    build.mkdir(parents=True, exist_ok=True)
    return build


@contextlib.contextmanager
def _exclusive(build: Path) -> Iterator[None]:
    """One process at a time builds or loads into `build`, under a lock the kernel releases when
    its holder dies. torch's own lock there is a file that a build killed midway (Ctrl-C at the
    first start) leaves behind, and every later start would wait on it forever: holding ours, a
    torch lock file is a dead builder's, and is removed."""
    with open(build / "radixserve.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            stale = build / "lock"
            if stale.exists():
                log.warning("removing %s, left by a build that did not finish", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


_NATIVE_DTYPES = (torch.float32, torch.bfloat16)


def _require_native(what: str, *tensors: torch.Tensor) -> None:
    if not _usable(*tensors):
        raise RuntimeError(f"{what} needs the CPU extension and float32 / bfloat16 CPU tensors")


def _usable(*tensors: torch.Tensor) -> bool:
    # On every op of the hot path: a plain loop, no generator. The device first: a GPU process
    # never builds the extension.
    for t in tensors:
        if t.dtype not in _NATIVE_DTYPES or t.device.type != "cpu":
            return False
    return native_ops() is not None


def _usable_pool(k_buf: torch.Tensor, v_buf: torch.Tensor) -> bool:
    """Whether the kernels read these K/V pool buffers: float32 / bf16, or an int8 pool's rows."""
    if k_buf.dtype == v_buf.dtype == torch.int8:
        return k_buf.device.type == v_buf.device.type == "cpu" and native_ops() is not None
    return _usable(k_buf, v_buf)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, float32 math; rounds to x.dtype before the weight (as HF)."""
    if _usable(x, weight) and x.dtype == weight.dtype and x.dim() == 2 and x.stride(-1) == 1:
        return native_ops().rms_norm(x, weight, eps)
    return rms_norm_torch(x, weight, eps)


def add_rms_norm_(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """h += delta (in place, in h's dtype), then return rms_norm(h)."""
    if (
        _usable(h, delta, weight)
        and h.dtype == delta.dtype == weight.dtype
        and h.dim() == 2
        and h.is_contiguous()
        and delta.is_contiguous()
    ):
        return native_ops().add_rms_norm_(h, delta, weight, eps)
    h.add_(delta)
    return rms_norm_torch(h, weight, eps)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Neox rotary in place on x [T, heads, D] (a strided view is fine); cos/sin [T, D/2]."""
    if _usable(x, cos, sin) and x.dtype == cos.dtype == sin.dtype and x.stride(-1) == 1:
        native_ops().rotary_(x, cos, sin)
    else:
        rotary_torch_(x, cos, sin)


def store_kv_(
    k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor
) -> bool:
    """k_buf[slots] = k and v_buf[slots] = v for k, v [T, heads, D] (heads adjacent: views of a
    fused qkv output), in one call; False, untouched, where the extension cannot (the caller then
    copies with torch)."""
    if not (
        _usable(k, v)
        and _usable_pool(k_buf, v_buf)
        and k.dtype == v.dtype
        and k_buf.dtype == v_buf.dtype in (k.dtype, torch.int8)  # int8: quantized as stored
        and slots.dtype == torch.int64
        and slots.is_contiguous()
        and k.dim() == 3
        and k.stride(-1) == 1
        and v.stride(-1) == 1
        and k.stride(1) == k.shape[2]
        and v.stride(1) == v.shape[2]
        and k_buf.is_contiguous()
        and v_buf.is_contiguous()
    ):
        return False
    native_ops().store_kv_(k, v, k_buf, v_buf, slots)
    return True


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> silu(gate) * up, [T, I]."""
    if _usable(gate_up) and gate_up.dim() == 2 and gate_up.is_contiguous():
        return native_ops().silu_mul(gate_up)
    return silu_mul_torch(gate_up)


def lora_bgmv_(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor,
    bs: list[torch.Tensor],
    offsets: list[int],
    slots: torch.Tensor,
) -> bool:
    """y[t, off_p:off_p + n_p] += (x[t] @ a[s])[p*R:(p+1)*R] @ bs[p][s] for s = slots[t] >= 0, in
    place (a [S, K, P*R], bs[p] [S, R, n_p]); False, untouched, where the extension cannot run it
    (the caller computes it with torch)."""
    if not (_usable(x, y, a) and x.is_contiguous() and y.is_contiguous()):
        return False
    native_ops().lora_bgmv_(x, y, a, bs, offsets, slots)
    return True


def decode_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    kv_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    fixed_order: bool = False,
) -> torch.Tensor:
    """q [B, H, D] -> [B, H, D]: sequence b attends to slots kv_indices[b, :seq_lens[b]].

    fixed_order: the extension's extend_attention arithmetic (key blocks of 32 from position 0),
    so that a token's output is bitwise what extend_attention_native gives it at that position, in
    any batch; needs the extension (RuntimeError without it)."""
    if fixed_order:
        _require_native("fixed-order decode attention", q, k_buf, v_buf)
        return native_ops().decode_attention_fixed(
            q, k_buf, v_buf, kv_indices.contiguous(), seq_lens.contiguous(), 1.0 / math.sqrt(q.shape[-1])
        )
    if (
        _usable(q)
        and _usable_pool(k_buf, v_buf)
        and (q.dtype == k_buf.dtype == v_buf.dtype or _int8_pool(q, k_buf, v_buf))
        and q.stride(-1) == 1
        and kv_indices.is_contiguous()
        and seq_lens.is_contiguous()
    ):
        return native_ops().decode_attention(
            q, k_buf, v_buf, kv_indices, seq_lens, 1.0 / math.sqrt(q.shape[-1])
        )
    return decode_attention_torch(q, k_buf, v_buf, kv_indices, seq_lens)


def extend_attention_native(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    kv_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_extend: torch.Tensor,
    bf16_products: bool = False,
) -> torch.Tensor | None:
    """Causal prefill attention for a whole batch over the pool (new K/V already stored), or None
    where the extension cannot run it (the caller then uses SDPA per sequence).

    bf16_products: for bfloat16 tensors where the CPU has AVX512-BF16, the q.k and p.v products
    in bf16 dot-product instructions (float32 softmax and sums; the softmax weights rounded to
    bf16), about twice as fast; otherwise float32 math throughout, the batch-invariant arithmetic
    that decode_attention's fixed_order reproduces."""
    if not (
        _usable(q)
        and _usable_pool(k_buf, v_buf)
        and (q.dtype == k_buf.dtype == v_buf.dtype or _int8_pool(q, k_buf, v_buf))
        and q.stride(-1) == 1
    ):
        return None
    ops = native_ops()
    if (
        bf16_products
        and q.dtype == torch.bfloat16
        and q.shape[-1] in (64, 128)
        and ops.extend_bf16_available()
    ):
        kernel = ops.extend_attention_bf16
    elif k_buf.dtype == torch.int8:
        return None  # the int8 pool is read by the bf16 kernel only
    else:
        kernel = ops.extend_attention
    return kernel(
        q,
        k_buf,
        v_buf,
        kv_indices.contiguous(),
        seq_lens.contiguous(),
        cu_extend.contiguous(),
        1.0 / math.sqrt(q.shape[-1]),
    )


def _int8_pool(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor) -> bool:
    return q.dtype == torch.bfloat16 and k_buf.dtype == v_buf.dtype == torch.int8


def kv_int8_available(head_dim: int, group: int) -> bool:
    """Whether an int8 KV pool's kernels (csrc/kv_int8.h) run here for this head size and number
    of query heads a KV head (AVX512-BF16)."""
    ops = native_ops()
    return ops is not None and bool(ops.kv_int8_available(head_dim, group))


def kv_int8_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> the int8 pool's rows [..., D + 4] (csrc/kv_int8.h): x / scale rounded to int8
    (half to even), scale = max|x| / 127 in float32 (0, and zeros, for an all-zero row), the
    scale's bytes after the values. What store_kv_ writes into an int8 pool, bitwise."""
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True) / 127.0
    q = torch.where(scale > 0, torch.round(xf / scale.clamp(min=torch.finfo(torch.float32).tiny)), 0.0)
    return torch.cat([q.clamp(-127, 127).to(torch.int8), scale.view(torch.int8)], dim=-1)


def kv_int8_values(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The int8 pool's rows [..., D + 4] -> their values [..., D] (each int8 times its row's scale)."""
    scale = rows[..., -4:].contiguous().view(torch.float32)
    return (rows[..., :-4].float() * scale).to(dtype)


GEMM_STRIP = 16  # output columns per packed strip (csrc/gemm.h)


def gemm_available(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """Whether linear layers of this dtype/device can run packed (bf16, AVX512-BF16 CPU)."""
    if dtype != torch.bfloat16 or torch.device(device).type != "cpu":
        return False
    ops = native_ops()
    return ops is not None and ops.gemm_available()


def pack_linear_weight(w: torch.Tensor) -> torch.Tensor:
    """W [N, K] -> [ceil(N/16), K/2, 16, 2]: 16-column strips of k pairs (csrc/gemm.h's layout)."""
    n, k = w.shape
    if k % 2:
        raise ValueError(f"packed weights need an even in_features, got {k}")
    strips = -(-n // GEMM_STRIP)
    padded = w.new_zeros(strips * GEMM_STRIP, k)
    padded[:n] = w
    return padded.view(strips, GEMM_STRIP, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def unpack_linear_weight(wp: torch.Tensor, n: int) -> torch.Tensor:
    strips, pairs = wp.shape[:2]
    return wp.permute(0, 2, 1, 3).reshape(strips * GEMM_STRIP, pairs * 2)[:n]


def packed_linear(
    x: torch.Tensor, wp: torch.Tensor, n: int, bias: torch.Tensor | None, fixed_order: bool = False
) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) with W packed by pack_linear_weight; bias float32 [N] or None.

    fixed_order: each output element sums over K in one order whatever the number of rows, so a
    row's result is bitwise independent of the rows beside it (the kernel's default order depends
    on the row tile): on AMX tiles where the CPU has them (csrc/gemm_amx.h; faster than the default
    kernel from a few rows up), else in 4 fixed AVX512-BF16 chains. Needs the kernel (RuntimeError
    without it)."""
    x2 = x.reshape(-1, x.shape[-1])
    if fixed_order:
        if not gemm_available(x2.dtype, x2.device) or wp.dtype != torch.bfloat16:
            raise RuntimeError("the fixed-order GEMM needs bfloat16 on a CPU with AVX512-BF16")
        return native_ops().packed_linear_fixed(x2, wp, n, bias).view(*x.shape[:-1], n)
    if (
        _usable(x2, wp)
        and x2.dtype == wp.dtype == torch.bfloat16
        and x2.stride(-1) == 1
        and native_ops().gemm_available()
    ):
        y = native_ops().packed_linear(x2, wp, n, bias)
    else:
        y = F.linear(x2.float(), unpack_linear_weight(wp, n).float(), bias).to(x.dtype)
    return y.view(*x.shape[:-1], n)


# The torch versions: fallbacks where the extension is unavailable, and the references its tests
# compare against.


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype) * weight


def rotary_torch_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    x.copy_(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))


def silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def decode_attention_torch(q, k_buf, v_buf, kv_indices, seq_lens) -> torch.Tensor:
    batch_size, width = kv_indices.shape
    kv_heads, head_dim = k_buf.shape[1], q.shape[-1]
    group = q.shape[1] // kv_heads
    flat = kv_indices.reshape(-1)

    def gather(buf):  # -> [B, KVH, L, D] float32, contiguous for the matmuls
        rows = buf.index_select(0, flat)
        if buf.dtype == torch.int8:  # an int8 pool's rows carry their scales
            rows = kv_int8_values(rows)
        rows = rows.view(batch_size, width, kv_heads, head_dim)
        return rows.permute(0, 2, 1, 3).to(torch.float32, memory_format=torch.contiguous_format)

    # The query heads of one KV group become G query rows against that group's keys.
    queries = q.reshape(batch_size, kv_heads, group, head_dim).float()
    scores = torch.matmul(queries, gather(k_buf).transpose(-1, -2)).mul_(1.0 / math.sqrt(head_dim))
    beyond = torch.arange(width, device=q.device).unsqueeze(0) >= seq_lens.unsqueeze(1)  # [B, L]
    scores.masked_fill_(beyond[:, None, None, :], float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), gather(v_buf))  # [B, KVH, G, D]
    return out.view(batch_size, kv_heads * group, head_dim).to(q.dtype)
