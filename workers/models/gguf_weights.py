"""A GGUF file's quantized tensors kept as they are (`--quantization gguf`).

Each of llama.cpp's block formats below is repacked, value for value, into the kernels' group form
(kernels/quant_ops.py): the integers and the per-block scales move, nothing is rounded.

    Q4_0  32 / block: d, 16 bytes of nibbles        W = d * (q - 8)            -> 4 bits, group 32
    Q4_1  32 / block: d, m, 16 bytes of nibbles     W = d * q + m              -> 4 bits, group 32
    Q5_0  32 / block: d, 32 high bits, nibbles      W = d * (q - 16)           -> 8 bits, group 32
    Q5_1  32 / block: d, m, 32 high bits, nibbles   W = d * q + m              -> 8 bits, group 32
    Q8_0  32 / block: d, 32 int8                    W = d * q                  -> 8 bits, group 32
    Q4_K  256 / block: d, dmin, 8 x 6-bit (scale, min), 4-bit q
                                                    W = d*sc_j * q - dmin*m_j  -> 4 bits, group 32
    Q5_K  as Q4_K with a fifth bit per value        W = d*sc_j * q - dmin*m_j  -> 8 bits, group 32
    Q6_K  256 / block: 16 int8 scales, 6-bit q, d   W = d*sc_j * (q - 32)      -> 8 bits, group 16

Tensors of other types (F32, F16, Q2_K, Q3_K, the IQ formats) are left to the dequantized
checkpoint. llama's q/k rows, which llama.cpp interleaves per head for its rotary, are put back in
Hugging Face order by moving whole rows (blocks never straddle rows). `apply_gguf_weights_`
checks every repacked tensor against the dequantized checkpoint the model was loaded from
(gguf_convert.py) and refuses the file on any difference.
"""

from __future__ import annotations

import logging
import math
import mmap
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from radixserve.kernels.quant_ops import QuantTensor, compact_scales, pack_int4

log = logging.getLogger(__name__)

# llama.cpp's names for a decoder layer's projections and the global tensors.
_BLOCK = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL = {"token_embd": "model.embed_tokens", "output": "lm_head"}


def _f16(b: torch.Tensor, lo: int) -> torch.Tensor:
    """The little-endian float16 at bytes [lo, lo + 2) of every block, as float32 [N, blocks]."""
    return b[..., lo : lo + 2].contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32] values: low nibbles (elements 0-15), then high (16-31)."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """[..., 4] bytes (a little-endian uint32) -> [..., 32] bits, bit e for element e."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((qh[..., :, None] >> shifts) & 1).flatten(-2)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes -> the 8 sub-blocks' 6-bit scales and mins, int32 [..., 8]."""
    s = s.int()
    lo_sc, lo_m = s[..., 0:4] & 63, s[..., 4:8] & 63
    hi_sc = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
    hi_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return torch.cat([lo_sc, hi_sc], -1), torch.cat([lo_m, hi_m], -1)


def _groups(t: torch.Tensor, n: int) -> torch.Tensor:
    return t.reshape(n, -1).contiguous()


def _quant(n: int, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, group: int, bits: int):
    sc, off = compact_scales(_groups(scale, n), None if offset is None else _groups(offset, n))
    return QuantTensor(q, sc, off, group, bits)


def _q4(n: int, values: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group: int) -> QuantTensor:
    return _quant(n, pack_int4(values.reshape(n, -1)), scale, offset, group, 4)


def _q8(
    n: int, values: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, group: int
) -> QuantTensor:
    return _quant(n, values.reshape(n, -1).to(torch.int8).contiguous(), scale, offset, group, 8)


def _q4_0(b: torch.Tensor, n: int) -> QuantTensor:
    d = _f16(b, 0)
    return _quant(n, _groups(b[..., 2:18], n), d, -8.0 * d, 32, 4)


def _q4_1(b: torch.Tensor, n: int) -> QuantTensor:
    return _quant(n, _groups(b[..., 4:20], n), _f16(b, 0), _f16(b, 2), 32, 4)


def _q5_0(b: torch.Tensor, n: int) -> QuantTensor:
    q = _nibbles(b[..., 6:22]).short() | (_high_bits(b[..., 2:6]).short() << 4)
    return _q8(n, q - 16, _f16(b, 0), None, 32)


def _q5_1(b: torch.Tensor, n: int) -> QuantTensor:
    q = _nibbles(b[..., 8:24]).short() | (_high_bits(b[..., 4:8]).short() << 4)
    return _q8(n, q, _f16(b, 0), _f16(b, 2), 32)


def _q8_0(b: torch.Tensor, n: int) -> QuantTensor:
    return _q8(n, b[..., 2:34].contiguous().view(torch.int8), _f16(b, 0), None, 32)


def _k_scale_offset(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    sc, m = _k_scales(b[..., 4:16])
    return _f16(b, 0)[..., None] * sc.float(), -(_f16(b, 2)[..., None] * m.float())


def _q4_k(b: torch.Tensor, n: int) -> QuantTensor:
    qs = b[..., 16:144].reshape(*b.shape[:-1], 4, 32)  # 4 chunks of 64: low nibbles, then high
    values = torch.stack([qs & 15, qs >> 4], dim=-2)  # [..., 4, 2, 32]: sub-blocks in order
    scale, offset = _k_scale_offset(b)
    return _q4(n, values, scale, offset, 32)


def _q5_k(b: torch.Tensor, n: int) -> QuantTensor:
    qh = b[..., 16:48]  # bit 2c of byte l: element 64c + l; bit 2c + 1: element 64c + 32 + l
    qs = b[..., 48:176].reshape(*b.shape[:-1], 4, 32)
    shifts = torch.arange(4, dtype=torch.uint8)[:, None] * 2  # [4, 1]
    lo = (qs & 15).short() | (((qh[..., None, :] >> shifts) & 1).short() << 4)
    hi = (qs >> 4).short() | (((qh[..., None, :] >> (shifts + 1)) & 1).short() << 4)
    scale, offset = _k_scale_offset(b)
    return _q8(n, torch.stack([lo, hi], dim=-2), scale, offset, 32)


def _q6_k(b: torch.Tensor, n: int) -> QuantTensor:
    ql = b[..., 0:128].reshape(*b.shape[:-1], 2, 2, 32)  # [half, first/second 32 bytes, l]
    qh = b[..., 128:192].reshape(*b.shape[:-1], 2, 32)
    quarters = [
        (ql[..., 0, :] & 15, 0),
        (ql[..., 1, :] & 15, 2),
        (ql[..., 0, :] >> 4, 4),
        (ql[..., 1, :] >> 4, 6),
    ]
    q = torch.stack([low.short() | (((qh >> shift) & 3).short() << 4) for low, shift in quarters], dim=-2)
    scales = b[..., 192:208].contiguous().view(torch.int8).float()
    return _q8(n, q - 32, _f16(b, 208)[..., None] * scales, None, 16)


# GGML type id -> (elements per block, bytes per block, decoder)
_DECODERS: dict[int, tuple[int, int, Callable[[torch.Tensor, int], QuantTensor]]] = {
    2: (32, 18, _q4_0),
    3: (32, 20, _q4_1),
    6: (32, 22, _q5_0),
    7: (32, 24, _q5_1),
    8: (32, 34, _q8_0),
    12: (256, 144, _q4_k),
    13: (256, 176, _q5_k),
    14: (256, 210, _q6_k),
}


def decode_blocks(type_id: int, raw: torch.Tensor, k: int) -> QuantTensor:
    """A GGUF tensor's raw blocks (uint8 [N, bytes per row]) of a type in _DECODERS, K elements a
    row -> the same values as a QuantTensor."""
    per_block, nbytes, decoder = _DECODERS[type_id]
    n = raw.shape[0]
    if k % per_block or raw.shape[1] != k // per_block * nbytes:
        raise ValueError(f"GGUF type {type_id}: {raw.shape[1]} bytes do not hold a row of {k}")
    return decoder(raw.reshape(n, k // per_block, nbytes), n)


def supported(type_id: int) -> bool:
    return type_id in _DECODERS


def llama_rows(rows: int, heads: int) -> torch.Tensor:
    """The GGUF row that holds each Hugging Face row of a llama q/k projection (llama.cpp moves
    HF row j * half + i of a head to 2 * i + j)."""
    half = rows // heads // 2
    return torch.arange(rows).reshape(heads, half, 2).transpose(1, 2).reshape(rows)


def hf_name(gguf_name: str) -> str | None:
    """A llama.cpp tensor name -> the Hugging Face module name, or None if not a projection."""
    parts = gguf_name.split(".")
    if parts[-1] != "weight":
        return None
    if len(parts) == 2:
        return _GLOBAL.get(parts[0])
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _BLOCK:
        return f"model.layers.{parts[1]}.{_BLOCK[parts[2]]}"
    return None


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type_id: int
    dims: tuple[int, ...]  # as stored: dims[0] is a row's length
    offset: int  # of its bytes in the file
    nbytes: int


# A metadata value's fixed size by GGUF type id (8 string and 9 array are read as they come).
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def tensor_index(path: str | Path) -> tuple[dict[str, object], list[GGUFTensor]]:
    """The GGUF file's metadata scalars and strings (arrays skipped) and where each tensor's bytes
    lie. gguf's own GGUFReader builds every metadata array element into numpy views first: 2.5 s
    for the default model's 98k vocabulary strings, on every engine start; this walks past them."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        at = 0

        def take(fmt: str) -> Any:
            nonlocal at
            (v,) = struct.unpack_from("<" + fmt, buf, at)
            at += struct.calcsize(fmt)
            return v

        def string() -> str:
            nonlocal at
            n = take("Q")
            at += n
            return buf[at - n : at].decode("utf-8", errors="replace")

        def skip(type_id: int) -> None:
            nonlocal at
            if type_id == 8:
                n = take("Q")  # (not `at += take(...)`: that adds to `at` as it was before the read)
                at += n
            elif type_id == 9:
                elem, count = take("I"), take("Q")
                if elem in _SCALAR:
                    at += _SCALAR[elem] * count
                else:
                    for _ in range(count):
                        skip(elem)
            else:
                at += _SCALAR[type_id]

        if bytes(buf[:4]) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        at = 4
        version, count, kv_count = take("I"), take("Q"), take("Q")
        if not 2 <= version <= 3:  # (a big-endian file's version reads as 3 << 24 here)
            raise ValueError(f"{path}: GGUF version {version} is not read (2 and 3, little-endian)")
        meta: dict[str, object] = {}
        fmt = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
        for _ in range(kv_count):
            key, type_id = string(), take("I")
            if type_id == 8:
                meta[key] = string()
            elif type_id in fmt:
                meta[key] = take(fmt[type_id])
            else:
                skip(type_id)
        infos = []
        for _ in range(count):
            name, n_dims = string(), take("I")
            dims = tuple(take("Q") for _ in range(n_dims))
            infos.append((name, dims, take("I"), take("Q")))
        align = int(meta.get("general.alignment", 32))  # type: ignore[call-overload]
        start = -(-at // align) * align
    finally:
        buf.close()
    tensors = []
    for name, dims, type_id, offset in infos:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
        elements = math.prod(dims)
        tensors.append(GGUFTensor(name, type_id, dims, start + offset, elements // block * size))
    return meta, tensors


def read_quantized(path: str | Path, heads: int, kv_heads: int) -> tuple[dict[str, QuantTensor], dict]:
    """(Hugging Face module name -> its weight as a QuantTensor, for every projection and the
    embedding stored in a supported type; {type name: count} of those left dequantized)."""
    from gguf.constants import GGMLQuantizationType

    meta, tensors = tensor_index(path)
    arch = meta.get("general.architecture")
    data = np.memmap(path, dtype=np.uint8, mode="r")
    out: dict[str, QuantTensor] = {}
    skipped: dict[str, int] = {}
    for t in tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        if not supported(t.type_id):
            kind = GGMLQuantizationType(t.type_id).name
            skipped[kind] = skipped.get(kind, 0) + 1
            continue
        raw = torch.from_numpy(np.array(data[t.offset : t.offset + t.nbytes]))
        qt = decode_blocks(t.type_id, raw.view(math.prod(t.dims[1:]), -1), t.dims[0])
        if arch == "llama" and name.endswith(("q_proj", "k_proj")):
            qt = qt.select_rows(llama_rows(qt.n, heads if name.endswith("q_proj") else kv_heads))
        out[name] = qt
    return out, skipped


def apply_gguf_weights_(model: nn.Module, gguf_path: str | Path, heads: int, kv_heads: int) -> int:
    """Compute every projection (and the embedding, and a tied LM head) of a model loaded from
    `gguf_path`'s dequantized checkpoint from the file's own blocks. Returns how many modules.
    Raises ValueError if a repacked tensor differs from what the model loaded."""
    from radixserve.workers.models.quant_weight import quantize_modules_

    tensors, skipped = read_quantized(gguf_path, heads, kv_heads)
    if skipped:
        log.info("GGUF tensors left dequantized (types without a kernel): %s", skipped)
    return quantize_modules_(model, tensors, "load this file with --quantization none")
