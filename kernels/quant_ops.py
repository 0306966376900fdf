"""Group-quantized weights and the matmul over them.

A `QuantTensor` holds W [N, K] as integers q with a scale and an optional offset (float32, or
float16 where they fit it exactly) per group of `group` consecutive input features of a row:

    W[n, c] = scale[n, c // group] * q[n, c] + offset[n, c // group]

q is 4-bit (unsigned 0..15; the offset carries any zero point) or 8-bit (signed). Every weight
format served is repacked into this form at load, without changing a single value:

    per-channel int8 (`quantize_int8`)      8 bits, group K, no offset
    GGUF Q8_0 / Q5_0 / Q6_K                8 bits, group 32 / 32 / 16, no offset
    GGUF Q5_1 / Q5_K                       8 bits, group 32, offset
    GGUF Q4_0 / Q4_1 / Q4_K                4 bits, group 32, offset
    AWQ / GPTQ / compressed-tensors int4   4 bits, their group (128), offset = -scale * zero

4-bit rows are blocks of 32 elements in 16 bytes, byte t holding element t in its low nibble and
element t + 16 in its high one (`pack_int4`). csrc/quant_gemm.h computes few rows of x from the
integers, widened in registers; from `dequant_rows(bits)` rows up the weight is dequantized for
torch's GEMM, which reuses each weight tile across many rows (the dequantization, N*K, is then
small beside the M*N*K of the product). Without the extension (or off the CPU) the weight is
dequantized in torch.

For bf16 activations on AVX512-BF16 CPUs a `StripTensor` holds the same integers, scales and
offsets in strips of 16 rows (csrc/quant_strips.h), for a kernel that serves many rows of x per
read of the weight, as the packed bf16 GEMM does; with AVX-512 VNNI it also takes int8
activations (below), as integers in the same layout.

Optionally (`int8_activations`, the engine's `quantized_activations="int8"`), decode rows of x are
rounded to int8 per block of 32 and multiplied with the weights as integers, as llama.cpp does:
faster per weight, and the activations' rounding is then the only difference from the float
path, whose results equal dequantize-then-matmul up to float32 summation order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixserve.kernels import cpu_ops

# Rows from which dequantize + torch GEMM beats the fused kernel (load_tests/bench_quant.py
# --crossover measures it; 2-core AVX2 host, SmolLM2-135M shapes, float32 activations).
DEQUANT_ROWS = {4: 32, 8: 32}
# Rows from which dequantize + torch GEMM beats the strip kernel (StripTensor): load_tests/
# bench_quant.py --strips-crossover, 2-core AVX512-BF16 host, the default model's 4-bit shapes:
# at 192 rows the strips took 0.93x (qkv), 1.00x (gate_up), 1.27x (down) its time, at 256 rows
# 1.14x, 1.02x, 1.32x. (The 49152-row LM head dequantizes slower than it computes up to 512 rows;
# only sampled rows reach it.)
STRIP_DEQUANT_ROWS = 192
# Rows of x below which int8 activations take the integer kernel (csrc/quant_gemm.h kInt8Rows;
# from there the float tile path is faster).
INT8_ACTIVATION_ROWS = 4
_FUSED_DTYPES = (torch.float32, torch.bfloat16)
_SCALE_DTYPES = (torch.float32, torch.float16)


@dataclass(frozen=True)
class QuantTensor:
    qweight: torch.Tensor  # 4 bits: uint8 [N, K / 2] (pack_int4's order); 8 bits: int8 [N, K]
    scale: torch.Tensor  # float32 or float16 [N, K / group]
    offset: torch.Tensor | None  # [N, K / group] of scale's dtype, or None for zero
    group: int
    bits: int

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits}")
        dtype = torch.uint8 if self.bits == 4 else torch.int8
        if self.qweight.dim() != 2 or self.qweight.dtype != dtype:
            raise ValueError(f"{self.bits}-bit qweight must be a 2-D {dtype} tensor")
        if self.group <= 0 or self.k % self.group or (self.bits == 4 and self.group % 32):
            raise ValueError(
                f"group {self.group} must divide K {self.k}"
                + (" and be a multiple of 32" if self.bits == 4 else "")
            )
        shape = (self.n, self.k // self.group)
        if self.scale.dtype not in _SCALE_DTYPES:
            raise ValueError(f"scale must be float32 or float16, got {self.scale.dtype}")
        for name, t in (("scale", self.scale), ("offset", self.offset)):
            if t is not None and (tuple(t.shape) != shape or t.dtype != self.scale.dtype):
                raise ValueError(
                    f"{name} must be {list(shape)} of scale's dtype, got {t.dtype} {list(t.shape)}"
                )

    @property
    def n(self) -> int:
        return self.qweight.shape[0]

    @property
    def k(self) -> int:
        return self.qweight.shape[1] * (2 if self.bits == 4 else 1)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.qweight, self.scale, self.offset) if t is not None]

    def same_layout(self, other: QuantTensor) -> bool:
        """Whether rows of `other` can sit under rows of this one (`cat_rows`)."""
        return (self.bits, self.group, self.k, self.offset is None, self.scale.dtype) == (
            other.bits,
            other.group,
            other.k,
            other.offset is None,
            other.scale.dtype,
        )

    def select_rows(self, rows: torch.Tensor) -> QuantTensor:
        """The rows `rows` (int64 index) of W, in that order."""
        off = None if self.offset is None else self.offset[rows].contiguous()
        return QuantTensor(
            self.qweight[rows].contiguous(), self.scale[rows].contiguous(), off, self.group, self.bits
        )

    def to(self, device: torch.device | str) -> QuantTensor:
        """This weight on `device` (itself where it is there already)."""
        if self.qweight.device == torch.device(device):
            return self
        off = None if self.offset is None else self.offset.to(device)
        return QuantTensor(self.qweight.to(device), self.scale.to(device), off, self.group, self.bits)

    def narrow(self, rows: tuple[int, int] | None, cols: tuple[int, int] | None) -> QuantTensor | None:
        """Rows (output features) [lo, hi) and input features [lo, hi) of W: a tensor-parallel
        rank's slice. None when the input range cuts a group (or a 4-bit block of 32): such a
        slice has no exact form here."""
        qt = self
        if rows is not None:
            lo, hi = rows
            off = None if qt.offset is None else qt.offset[lo:hi].contiguous()
            qt = QuantTensor(
                qt.qweight[lo:hi].contiguous(), qt.scale[lo:hi].contiguous(), off, qt.group, qt.bits
            )
        if cols is not None:
            lo, hi = cols
            if lo % qt.group or hi % qt.group or (qt.bits == 4 and (lo % 32 or hi % 32)):
                return None
            per = 2 if qt.bits == 4 else 1
            g = slice(lo // qt.group, hi // qt.group)
            off = None if qt.offset is None else qt.offset[:, g].contiguous()
            qt = QuantTensor(
                qt.qweight[:, lo // per : hi // per].contiguous(),
                qt.scale[:, g].contiguous(),
                off,
                qt.group,
                qt.bits,
            )
        return qt

    def dequantize(
        self, dtype: torch.dtype = torch.float32, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """W (or its rows `rows`) as a dense [N or len(rows), K] tensor of `dtype`."""
        ops = cpu_ops.native_ops()
        if ops is not None and self.qweight.device.type == "cpu" and dtype in _FUSED_DTYPES:
            return ops.quant_dequantize(
                self.qweight, self.scale, self.offset, self.group, self.bits, rows, dtype
            )
        return dequantize_torch(self, rows).to(dtype)

    def linear(
        self,
        x: torch.Tensor,
        bias: torch.Tensor | None = None,
        dequant_rows: int | None = None,
        int8_activations: bool = False,
    ):
        """x [..., K] @ W^T (+ bias float32 [N]) -> [..., N] in x's dtype. `int8_activations`:
        decode rows of x are rounded to int8 per block of 32 and multiplied as integers, where
        the CPU has the kernel and the group is a multiple of 32 (INT8_ACTIVATION_ROWS)."""
        x2 = x.reshape(-1, x.shape[-1])
        below = DEQUANT_ROWS[self.bits] if dequant_rows is None else dequant_rows
        ops = cpu_ops.native_ops()
        if ops is not None and x2.device.type == "cpu" and x.dtype in _FUSED_DTYPES and x2.shape[0] < below:
            kernel = ops.quant_linear_int8_x if int8_activations else ops.quant_linear
            y = kernel(x2, self.qweight, self.scale, self.offset, self.group, self.bits, bias)
        else:
            b = None if bias is None else bias.to(x.dtype)
            y = F.linear(x2, self.dequantize(x.dtype), b)
        return y.view(*x.shape[:-1], self.n)


@dataclass(frozen=True)
class StripTensor:
    """A QuantTensor's weight in strips of 16 rows (csrc/quant_strips.h), for bf16 activations on
    AVX512-BF16 CPUs: the same integers, scales and offsets, laid out so that many rows of x share
    each read of the weight as the packed bf16 GEMM does (one row of x as fast as the row layout's
    kernel or faster; 16 rows about the packed bf16 GEMM's time on the default model's shapes,
    where the row layout took two to five times that: bench_quant --strips-crossover). `pack` makes one from a QuantTensor and `unpack` gives that back
    exactly."""

    data: torch.Tensor  # 4 bits: uint8 [S, K / 8, 64]; 8 bits: int8 [S, K / 2, 16, 2]
    scale: torch.Tensor  # [S, K / group, 16], float32 or float16
    offset: torch.Tensor | None  # like scale, or None for zero
    n: int
    group: int
    bits: int

    @staticmethod
    def fits(qt: QuantTensor) -> bool:
        """Whether `qt`'s layout packs into strips: every 4-bit one, and 8-bit groups of a
        multiple of 16 (the strip kernels read 16 columns of a group at a time)."""
        return qt.bits == 4 or qt.group % 16 == 0

    @classmethod
    def pack(cls, qt: QuantTensor) -> StripTensor:
        if not cls.fits(qt):
            raise ValueError(f"an 8-bit group of {qt.group} is not a multiple of 16: keep it in rows")
        ops = cpu_ops.native_ops()
        if ops is None or not ops.quant_strips_available():
            raise RuntimeError("strips need the CPU kernels on an AVX512-BF16 CPU")
        data, scale, *offset = ops.quant_strip_pack(qt.qweight, qt.scale, qt.offset, qt.group, qt.bits)
        return cls(data, scale, offset[0] if offset else None, qt.n, qt.group, qt.bits)

    @property
    def k(self) -> int:
        return self.data.shape[1] * (8 if self.bits == 4 else 2)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.data, self.scale, self.offset) if t is not None]

    def unpack(self, rows: torch.Tensor | None = None) -> QuantTensor:
        """The QuantTensor this was packed from (or its rows `rows`, an int64 index)."""
        ops = cpu_ops.native_ops()
        q = ops.quant_strip_unpack(self.data, self.n, self.bits, rows)
        count = self.n if rows is None else rows.numel()

        def rows_of(t: torch.Tensor) -> torch.Tensor:  # [S, groups, 16] -> [N or R, groups]
            flat = t.transpose(1, 2).reshape(-1, t.shape[1])[: self.n]
            return (flat if rows is None else flat[rows]).contiguous().view(count, -1)

        offset = None if self.offset is None else rows_of(self.offset)
        return QuantTensor(q, rows_of(self.scale), offset, self.group, self.bits)

    def dequantize(
        self, dtype: torch.dtype = torch.float32, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """W (or its rows `rows`) as a dense [N or len(rows), K] tensor of `dtype`."""
        ops = cpu_ops.native_ops()
        if rows is None and dtype in _FUSED_DTYPES:
            return ops.quant_strip_dequantize(
                self.data, self.scale, self.offset, self.n, self.group, self.bits, dtype
            )
        return self.unpack(rows).dequantize(dtype)

    def linear(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, int8_activations: bool = False
    ) -> torch.Tensor:
        """x [..., K] @ W^T (+ bias float32 [N]) -> [..., N] in x's dtype: bf16 x of fewer than
        STRIP_DEQUANT_ROWS rows on the strip kernel; more rows (prefill), or another dtype,
        dequantize for torch's GEMM. `int8_activations` (AVX-512 VNNI, `strips_int8_available`):
        those rows rounded to int8 per block of 32 and multiplied as integers, where the group is
        a multiple of 32 (in bf16 otherwise)."""
        if int8_activations and not strips_int8_available():
            raise ValueError("strips multiply int8 rows of x only with AVX-512 VNNI; unpack them")
        x2 = x.reshape(-1, x.shape[-1])
        ops = cpu_ops.native_ops()
        if x.dtype == torch.bfloat16 and x2.device.type == "cpu" and x2.shape[0] < STRIP_DEQUANT_ROWS:
            y = ops.quant_strip_linear(
                x2, self.data, self.scale, self.offset, self.n, self.group, self.bits, bias, int8_activations
            )
        else:
            b = None if bias is None else bias.to(x.dtype)
            y = F.linear(x2, self.dequantize(x.dtype).to(x.device), b)
        return y.view(*x.shape[:-1], self.n)


def strips_available() -> bool:
    """Whether StripTensor's kernel runs here (the CPU kernels on an AVX512-BF16 CPU)."""
    ops = cpu_ops.native_ops()
    return ops is not None and bool(ops.quant_strips_available())


def strips_int8_available() -> bool:
    """Whether StripTensor multiplies int8 rows of x as integers here (AVX-512 VNNI)."""
    ops = cpu_ops.native_ops()
    return strips_available() and ops is not None and bool(ops.quant_strips_i8_available())


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] of 0..15 (K a multiple of 32) -> uint8 [N, K / 2] in the kernels' order."""
    n, k = values.shape
    if k % 32:
        raise ValueError(f"4-bit rows are blocks of 32 elements, got K {k}")
    if values.dtype != torch.uint8 or bool((values > 15).any()):
        raise ValueError("4-bit values are uint8 in 0..15")
    blocks = values.reshape(n, k // 32, 2, 16)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """pack_int4's inverse: uint8 [N, K / 2] -> uint8 [N, K] of 0..15."""
    n, half = packed.shape
    b = packed.reshape(n, half // 16, 16)
    return torch.cat([b & 15, b >> 4], dim=-1).reshape(n, half * 2)


def dequantize_torch(qt: QuantTensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The dequantization in torch (float32): the reference, and the path off the CPU."""
    q, scale, offset = qt.qweight, qt.scale, qt.offset
    if rows is not None:
        q, scale = q[rows], scale[rows]
        offset = None if offset is None else offset[rows]
    values = unpack_int4(q) if qt.bits == 4 else q
    n, groups = scale.shape
    w = values.float().view(n, groups, qt.group) * scale.float()[..., None]
    if offset is not None:
        w = w + offset.float()[..., None]
    return w.view(n, qt.k)


def linear_torch(x: torch.Tensor, qt: QuantTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W^T (+ bias) in float32 from the torch dequantization, rounded once to x's dtype."""
    y = x.float() @ dequantize_torch(qt).T
    if bias is not None:
        y = y + bias
    return y.to(x.dtype)


def compact_scales(
    scale: torch.Tensor, offset: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(scale, offset) in float16 where every value of both is a float16 exactly (GGUF's own
    scales are), else float32 as given: half the bytes for the same weights."""
    both = [scale] if offset is None else [scale, offset]
    if all(bool(torch.equal(t.half().float(), t)) for t in both):
        return scale.half(), None if offset is None else offset.half()
    return scale, offset


def cat_rows(parts: Sequence[QuantTensor]) -> QuantTensor:
    """One QuantTensor whose rows are the parts' rows in order (parts of one layout)."""
    first = parts[0]
    if not all(first.same_layout(p) for p in parts):
        raise ValueError("only parts of one layout (bits, group, K, offset) are joined")
    offset = None if first.offset is None else torch.cat([p.offset for p in parts])  # type: ignore[misc]
    return QuantTensor(
        torch.cat([p.qweight for p in parts]),
        torch.cat([p.scale for p in parts]),
        offset,
        first.group,
        first.bits,
    )


def quantize_int8(w: torch.Tensor) -> QuantTensor:
    """Symmetric per-output-channel int8 of W [N, K] (any float dtype): scale[n] = max|W[n, :]| /
    127 (1 for an all-zero row), q = round(W / scale) clamped to [-127, 127]."""
    wf = w.detach().float()
    amax = wf.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(wf / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return QuantTensor(q.contiguous(), scale[:, None].contiguous(), None, w.shape[1], 8)
