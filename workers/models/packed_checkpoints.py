"""Checkpoints that arrive quantized: AWQ, GPTQ and compressed-tensors' pack-quantized int4/int8
safetensors, read into the kernels' group form (kernels/quant_ops.py) value for value.

    AWQ (GEMM)   qweight int32 [K, N/8]   8 columns a word, nibble order 0 2 4 6 1 3 5 7
                 qzeros  int32 [G, N/8]   the same order;  scales [G, N]
                 W[n, k] = (q - z) * s
    GPTQ         qweight int32 [K/8, N]   8 input rows a word, in order
                 qzeros  int32 [G, N/8]   8 columns a word, in order, stored minus one
                 scales [G, N], g_idx [K]  W[n, k] = (q - (z + 1)) * s   ("gptq_v2": z as stored)
    compressed-tensors pack-quantized (4 or 8 bits)
                 weight_packed int32 [N, K / (32 / bits)], values stored + 2^(bits-1)
                 weight_scale [N, G], weight_zero_point [N / (32 / bits), G] when asymmetric
                 W = (q - zp) * s
    fp8          weight float8_e4m3fn [N, K], weight_scale [] / [1] (per tensor) or [N] / [N, 1]
    (quant_method "fp8", and compressed-tensors float-quantized)      W = q * s
                 Block-wise scales (weight_block_size) are refused. input_scale (a static scale
                 for the activations) is not used: activations are scaled per row as they come
                 (kernels/fp8_ops.py). k_scale / v_scale (self_attn.k_scale, or the older
                 k_proj.output_scale) are kept in `kv_scales`: an fp8 KV cache's layer scales.

Group g of a row covers input features [g * group, (g + 1) * group): act-order checkpoints (a
`g_idx` that is not that) are refused. The scales arrive in float16 or bfloat16, so every
product scale * integer is exact in float32 and the group form holds the checkpoint's values
exactly. `PackedReader` turns a checkpoint's tensors into (name, dense weight) pairs that the
model loads as any checkpoint, and keeps each projection's QuantTensor aside; after loading,
`quantize_modules_` (quant_weight.py) makes the projections compute from those (fp8 ones as
kernels/fp8_ops.Fp8Tensor).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from radixserve.kernels.fp8_ops import FP8, Fp8Tensor
from radixserve.kernels.quant_ops import QuantTensor, compact_scales, pack_int4

log = logging.getLogger(__name__)

METHODS = ("awq", "gptq", "compressed-tensors", "fp8")
_AWQ_COLUMNS = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])  # column c sits in nibble _AWQ_COLUMNS[c]
_SUFFIXES = {
    "awq": ("qweight", "qzeros", "scales"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "compressed-tensors": (
        "weight_packed",
        "weight_scale",
        "weight_zero_point",
        "weight_shape",
        "weight_g_idx",
    ),
    "fp8": ("weight", "weight_scale"),
}
_REQUIRED = {
    "awq": ("qweight", "qzeros", "scales"),
    "gptq": ("qweight", "qzeros", "scales"),
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_shape"),
    "fp8": ("weight", "weight_scale"),
}
# Scales of an fp8 checkpoint that the engine does not use (see the module's docstring).
_FP8_UNUSED = ("input_scale",)
# An fp8 checkpoint's KV cache scales: "<layers>.N.self_attn.k_scale" or "...k_proj.output_scale".
_KV_SCALE = re.compile(r"layers\.(\d+)\.self_attn\.(?:([kv])_scale|([kv])_proj\.output_scale)$")


def checkpoint_method(model_dir: Path) -> tuple[str, dict[str, Any]] | None:
    """(method, quantization_config) of a checkpoint that arrives quantized, None for a plain
    one; ValueError for a quantization this build does not read."""
    config = json.loads((model_dir / "config.json").read_text()).get("quantization_config")
    if not config:
        return None
    method = str(config.get("quant_method", "")).lower()
    if method not in METHODS:
        raise ValueError(
            f"checkpoint quantization {method!r} is not supported; supported: {', '.join(METHODS)}"
        )
    if method == "compressed-tensors" and config.get("format") == "float-quantized":
        _check_float_groups(config)
        return "fp8", config
    if method == "fp8":
        if config.get("weight_block_size"):
            raise ValueError(
                "fp8 with block-wise scales (weight_block_size) is not read; per-tensor "
                "and per-channel scales are"
            )
    elif method == "compressed-tensors":
        if config.get("format") not in ("pack-quantized", None):
            raise ValueError(
                f"compressed-tensors format {config.get('format')!r}: pack-quantized and "
                "float-quantized are read"
            )
    elif int(config.get("bits", 4)) != 4:
        raise ValueError(f"{method} with {config.get('bits')} bits: only 4-bit checkpoints are read")
    if method == "awq" and str(config.get("version", "gemm")).lower() != "gemm":
        raise ValueError(f"AWQ version {config.get('version')!r}: only the GEMM layout is read")
    return method, config


def _check_float_groups(config: dict[str, Any]) -> None:
    for name, group in (config.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        kind = (weights.get("type"), int(weights.get("num_bits", 0)), weights.get("strategy"))
        if kind[:2] != ("float", 8) or kind[2] not in ("tensor", "channel"):
            raise ValueError(
                f"compressed-tensors group {name!r}: {kind[1]}-bit {kind[0]} weights by {kind[2]}; "
                "float-quantized is read for 8-bit float weights by tensor or channel"
            )


def fp8_tensor(weight: torch.Tensor, scale: torch.Tensor) -> Fp8Tensor:
    """An fp8 checkpoint weight [N, K] and its scale (one, or one per output row)."""
    if weight.dtype != FP8 or weight.dim() != 2:
        raise ValueError(f"an fp8 weight must be a 2-D {FP8} tensor, got {weight.dtype} {list(weight.shape)}")
    n = weight.shape[0]
    s = scale.float().reshape(-1)
    if s.numel() == 1:
        s = s.expand(n)
    elif s.numel() != n:
        raise ValueError(f"weight_scale {list(scale.shape)} is neither per tensor nor per row of {n}")
    return Fp8Tensor(weight.contiguous(), s.contiguous())


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> [..., W, 8] of 0..15, nibble i (bits 4i..4i+3) at index i."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return (words[..., None] >> shifts) & 15


def _group_of(k: int, groups: int) -> int:
    if groups <= 0 or k % groups:
        raise ValueError(f"{groups} scale groups do not divide {k} input features")
    return k // groups


def _form(values: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | float, bits: int) -> QuantTensor:
    """values int [N, K] (0..2^bits-1 for 4 bits, signed for 8), scale [N, G], zero [N, G] or a
    number: W = (values - zero) * scale -> the group form (offset = -zero * scale)."""
    scale = scale.float().contiguous()
    n, k = values.shape
    group = _group_of(k, scale.shape[1])
    offset = (-(zero * scale) if isinstance(zero, torch.Tensor) else -float(zero) * scale).contiguous()
    if bits == 4:
        sc, off = compact_scales(scale, offset)
        return QuantTensor(pack_int4(values.to(torch.uint8)), sc, off, group, 4)
    zero_free = not bool(offset.any())
    sc, off = compact_scales(scale, None if zero_free else offset)
    return QuantTensor(values.to(torch.int8).contiguous(), sc, off, group, 8)


def _check_g_idx(g_idx: torch.Tensor | None, k: int, group: int) -> None:
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k) // group):
        raise ValueError("act-order checkpoints (a g_idx out of order) are not supported")


def awq_tensor(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> QuantTensor:
    q = _nibbles(qweight)[..., _AWQ_COLUMNS].flatten(-2)  # [K, N]
    z = _nibbles(qzeros)[..., _AWQ_COLUMNS].flatten(-2)  # [G, N]
    return _form(q.T, scales.T, z.T.float(), 4)


def gptq_tensor(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None, v2: bool
) -> QuantTensor:
    q = _nibbles(qweight).transpose(1, 2).flatten(0, 1)  # [K/8, N, 8] -> [K, N]
    z = _nibbles(qzeros).flatten(-2).float() + (0 if v2 else 1)  # [G, N]
    _check_g_idx(g_idx, q.shape[0], _group_of(q.shape[0], scales.shape[0]))
    return _form(q.T, scales.T, z.T, 4)


def compressed_tensor(
    packed: torch.Tensor,
    scale: torch.Tensor,
    shape: torch.Tensor,
    zero_point: torch.Tensor | None,
    g_idx: torch.Tensor | None,
) -> QuantTensor:
    n, k = (int(v) for v in shape.tolist())
    bits = 32 * packed.shape[1] // k if k else 0
    if bits not in (4, 8) or packed.shape != (n, k * bits // 32):
        raise ValueError(
            f"weight_packed {list(packed.shape)} does not hold a [{n}, {k}] weight of 4 or 8 bits"
        )
    mid = 1 << (bits - 1)
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = ((packed[..., None] >> shifts) & ((1 << bits) - 1)).flatten(-2)[:, :k]  # stored, unsigned
    if scale.dim() == 1:
        scale = scale[:, None]
    _check_g_idx(g_idx, k, _group_of(k, scale.shape[1]))
    if zero_point is None:
        zero: torch.Tensor | float = float(mid)
    else:  # packed along the output dimension, stored + mid like the values
        zp = ((zero_point[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)).flatten(0, 1)[:n]
        zero = zp.float()
    if bits == 8:  # back to signed so that the values fit int8; the zero point moves with them
        return _form(values - mid, scale, zero - mid if isinstance(zero, torch.Tensor) else 0.0, 8)
    return _form(values, scale, zero, 4)


class PackedReader:
    """Reads a quantized checkpoint: `dense(weights)` yields the checkpoint with each quantized
    projection as its dense weight (for the model's ordinary loading), and fills `tensors` (Hugging
    Face module name -> QuantTensor) on the way."""

    def __init__(self, method: str, config: dict[str, Any]):
        self.method, self.config = method, config
        self.v2 = str(config.get("checkpoint_format", "gptq")).lower() == "gptq_v2"
        self.tensors: dict[str, QuantTensor | Fp8Tensor] = {}
        # (layer, "k" | "v") -> the scale an fp8 KV cache stores that layer's K or V divided by.
        self.kv_scales: dict[tuple[int, str], float] = {}

    def dense(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        pending: dict[str, dict[str, torch.Tensor]] = {}
        suffixes = _SUFFIXES[self.method]
        unused = 0
        for name, tensor in weights:
            module, _, leaf = name.rpartition(".")
            if self.method == "fp8" and (kv := _KV_SCALE.search(name)):
                self.kv_scales[(int(kv.group(1)), kv.group(2) or kv.group(3))] = float(tensor.float().max())
                continue
            if self.method == "fp8" and leaf in _FP8_UNUSED:
                unused += 1
                continue
            plain = self.method == "fp8" and leaf == "weight" and tensor.dtype != FP8
            if leaf not in suffixes or plain:
                yield name, tensor
                continue
            parts = pending.setdefault(module, {})
            parts[leaf] = tensor
            if all(key in parts for key in _REQUIRED[self.method]) and self._complete(parts):
                qt = self._decode(module, pending.pop(module))
                self.tensors[module] = qt
                yield f"{module}.weight", qt.dequantize(torch.float32)
        if pending:
            raise ValueError(f"quantized checkpoint tensors without all their parts: {sorted(pending)[:4]}")
        if unused:
            log.info(
                "fp8 checkpoint: %d static activation scales not used (activations are scaled "
                "per row at run time)",
                unused,
            )

    def _complete(self, parts: dict[str, torch.Tensor]) -> bool:
        # Optional parts (g_idx, zero points) may still follow in another shard: wait for the
        # ones the config says exist.
        if self.method == "gptq" and self.config.get("desc_act") and "g_idx" not in parts:
            return False
        if self.method == "compressed-tensors" and not self._symmetric() and "weight_zero_point" not in parts:
            return False
        return True

    def _symmetric(self) -> bool:
        groups = self.config.get("config_groups") or {}
        return all((g.get("weights") or {}).get("symmetric", True) for g in groups.values())

    def _decode(self, module: str, parts: dict[str, torch.Tensor]) -> QuantTensor | Fp8Tensor:
        try:
            if self.method == "fp8":
                return fp8_tensor(parts["weight"], parts["weight_scale"])
            if self.method == "awq":
                return awq_tensor(parts["qweight"], parts["qzeros"], parts["scales"])
            if self.method == "gptq":
                return gptq_tensor(
                    parts["qweight"], parts["qzeros"], parts["scales"], parts.get("g_idx"), self.v2
                )
            return compressed_tensor(
                parts["weight_packed"],
                parts["weight_scale"],
                parts["weight_shape"],
                parts.get("weight_zero_point"),
                parts.get("weight_g_idx"),
            )
        except (ValueError, RuntimeError, IndexError) as exc:
            raise ValueError(f"{module}: {exc}") from None
