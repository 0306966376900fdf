"""Quantized projections: a Linear computes through a QuantWeight once quantized (Linear.quantize_).

`--quantization int8` quantizes every projection at load, weight only, one scale per output
channel (kernels/quant_ops.quantize_int8), from whatever the checkpoint holds; `--quantization
fp8` likewise in e4m3 (kernels/fp8_ops.py: torch._scaled_mm on GPUs with fp8 tensor cores).
`--quantization gguf` keeps a GGUF file's own blocks (workers/models/gguf_weights.py); AWQ / GPTQ /
compressed-tensors checkpoints and fp8 ones arrive quantized (workers/models/packed_checkpoints.py). Under
tensor parallelism each rank holds the slice of its projections: int8 quantizes the slice (a row's
scale over the columns the rank holds), the others cut theirs along whole groups. A bf16 model on
an AVX512-BF16 CPU then lays its projections out in strips (`use_strips_`, quant_ops.StripTensor).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TypeAlias

import torch
from torch import nn

from radixserve.kernels.fp8_ops import Fp8Tensor, quantize_fp8
from radixserve.kernels.quant_ops import (
    QuantTensor,
    StripTensor,
    cat_rows,
    quantize_int8,
    strips_available,
    strips_int8_available,
)

log = logging.getLogger(__name__)

QUANTIZATIONS = ("auto", "none", "int8", "fp8", "gguf")
Part: TypeAlias = QuantTensor | StripTensor | Fp8Tensor
ACTIVATIONS = ("float", "int8")


class QuantWeight(nn.Module):
    """y = x @ W^T (+ bias) with W the rows of `parts` (QuantTensors or Fp8Tensors) in order; bias
    float32 [N].

    Adjacent parts of one layout (bits, group, offset; or fp8) are joined into one, so a fused
    q/k/v or gate/up layer whose parts share a format runs one kernel; a GGUF mix (Q4_K beside
    Q6_K) runs one per layout and writes the outputs side by side.
    """

    def __init__(self, parts: Sequence[QuantTensor | Fp8Tensor], bias: torch.Tensor | None):
        super().__init__()
        joined: list[list[QuantTensor | Fp8Tensor]] = []
        for part in parts:
            if joined and _same_layout(joined[-1][0], part):
                joined[-1].append(part)
            else:
                joined.append([part])
        self.parts: list[Part] = [group[0] if len(group) == 1 else _join(group) for group in joined]
        self.bounds = [0]
        for joined_part in self.parts:
            self.bounds.append(self.bounds[-1] + joined_part.n)
        self.out_features = self.bounds[-1]
        self._int8_activations = False  # decode rows multiplied as int8 (set_activations_)
        self.bias_f32 = None if bias is None else bias.float().contiguous()
        self._register_parts()
        if self.bias_f32 is not None:
            self.register_buffer("bias", self.bias_f32, persistent=False)

    def _register_parts(self) -> None:
        # Registered so that parameters() counts (and state_dict shows) what the weight holds.
        for name in [n for n in self._buffers if n.startswith("t")]:
            del self._buffers[name]
        for i, part in enumerate(self.parts):
            for j, t in enumerate(part.tensors()):
                self.register_buffer(f"t{i}_{j}", t, persistent=False)

    @property
    def int8_activations(self) -> bool:
        return self._int8_activations

    @int8_activations.setter
    def int8_activations(self, on: bool) -> None:
        if on and any(isinstance(part, Fp8Tensor) for part in self.parts):
            raise ValueError("int8 activations multiply integer weights, not fp8 ones")
        if on and not strips_int8_available():
            self.use_strips_(False)  # strips multiply int8 rows only with AVX-512 VNNI
        self._int8_activations = on

    def use_strips_(self, on: bool, shared: dict[int, StripTensor] | None = None) -> bool:
        """Lay the parts out in strips (StripTensor; bf16 activations, AVX512-BF16 CPUs) or back
        in rows. `shared`: parts already packed elsewhere, by their integers' data_ptr, reused
        (and this call's packings added). Returns whether any part changed."""
        changed = False
        parts: list[Part] = []
        for part in self.parts:
            if (
                on
                and isinstance(part, QuantTensor)
                and part.qweight.device.type == "cpu"
                and StripTensor.fits(part)
            ):
                key = part.qweight.data_ptr()
                strip = (shared or {}).get(key) or StripTensor.pack(part)
                if shared is not None:
                    shared[key] = strip
                parts.append(strip)
                changed = True
            elif not on and isinstance(part, StripTensor):
                parts.append(part.unpack())
                changed = True
            else:
                parts.append(part)
        self.parts = parts
        self._register_parts()
        return changed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        i8 = self.int8_activations
        if len(self.parts) == 1:
            return self.parts[0].linear(x, self.bias_f32, int8_activations=i8)
        b = self.bias_f32
        outs = [
            part.linear(x, None if b is None else b[lo:hi], int8_activations=i8)
            for part, lo, hi in zip(self.parts, self.bounds, self.bounds[1:])
        ]
        return torch.cat(outs, dim=-1)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([part.dequantize(dtype) for part in self.parts])

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)


def _same_layout(a: QuantTensor | Fp8Tensor, b: QuantTensor | Fp8Tensor) -> bool:
    if isinstance(a, QuantTensor) and isinstance(b, QuantTensor):
        return a.same_layout(b)
    return isinstance(a, Fp8Tensor) and a.same_layout(b)


def _join(group: Sequence[QuantTensor | Fp8Tensor]) -> QuantTensor | Fp8Tensor:
    if isinstance(group[0], Fp8Tensor):
        return Fp8Tensor.cat([p for p in group if isinstance(p, Fp8Tensor)])
    return cat_rows([p for p in group if isinstance(p, QuantTensor)])


def check_quantization(quantization: str, deterministic: bool = False) -> str:
    """The quantization name, or ValueError for one this build does not run."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; use one of {', '.join(QUANTIZATIONS)}")
    if quantization not in ("none", "auto") and deterministic:
        raise ValueError(
            "deterministic mode runs the fixed-order bf16 GEMM and does not take quantized weights"
        )
    return quantization


def quantize_int8_(model: nn.Module) -> int:
    """Quantize every projection of a loaded `model` (the LM head among them) and, at tp_size 1,
    the embedding (one scale per token's row; a tied LM head and the embedding share one int8
    table) in place; returns how many modules."""
    return _quantize_at_load_(model, quantize_int8)


def quantize_fp8_(model: nn.Module) -> int:
    """`quantize_int8_` in e4m3 (kernels/fp8_ops.quantize_fp8)."""
    return _quantize_at_load_(model, quantize_fp8)


def _quantize_at_load_(model: nn.Module, quantize) -> int:
    from radixserve.workers.models.linear import Linear
    from radixserve.workers.models.parallel_layers import VocabParallelEmbedding

    count = 0
    tables: dict[int, QuantTensor | Fp8Tensor] = {}  # weight storage -> its quantized table
    for module in model.modules():
        if isinstance(module, Linear):
            table = quantize(module.weight.data)
            quantized = QuantWeight([table], module.bias)
            tables[module.weight.data_ptr()] = table
            module.quantize_(quantized)
            count += 1
    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding) and module.group.world_size == 1:
            table = tables.get(module.weight.data_ptr()) or quantize(module.weight.data)
            module.quantize_(table)
            count += 1
    return count


def quantize_modules_(model: nn.Module, tensors: Mapping[str, QuantTensor | Fp8Tensor], remedy: str) -> int:
    """Make the modules of a loaded `model` compute from `tensors` (Hugging Face module name ->
    the full checkpoint weight, quantized): projections (fused q/k/v and gate/up when all their
    parts are there), the embedding, and a tied LM head with it. Under tensor parallelism each
    module takes its rank's slice (a slice that cuts a quantization group stays dense, logged).
    Every weight is checked against what the model loaded, ValueError naming `remedy` on a
    difference. Returns how many modules."""
    from radixserve.workers.models.linear import Linear
    from radixserve.workers.models.parallel_layers import VocabParallelEmbedding
    from radixserve.workers.models.weight_loader import FUSED

    by_module: dict[str, dict[int | None, QuantTensor | Fp8Tensor]] = {}  # our module -> {part: tensor}
    for name, qt in tensors.items():
        *path, leaf = name.split(".")
        part = None
        if leaf in FUSED:
            leaf, part = FUSED[leaf]
        by_module.setdefault(".".join([*path, leaf]), {})[part] = qt
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    if tied and "model.embed_tokens" in by_module:
        by_module["lm_head"] = by_module["model.embed_tokens"]
    count = 0
    for module_name, parts in by_module.items():
        module = model.get_submodule(module_name)
        if isinstance(module, VocabParallelEmbedding):
            if module.group.world_size > 1:
                continue  # its rows are padded per rank: the table stays dense
            table = parts[None].to(module.weight.device)
            _check_same(module_name, table.dequantize(module.weight.dtype), module.weight, remedy)
            module.quantize_(table)
        elif isinstance(module, Linear):
            sliced = _rank_slices(module_name, module, parts)
            if sliced is None:
                continue
            bias = None if module.bias is None else module.bias.detach().float()
            quantized = QuantWeight([qt.to(module.weight.device) for qt in sliced], bias)
            _check_same(module_name, quantized.dequantize(module.weight.dtype), module.weight, remedy)
            module.quantize_(quantized)
        else:
            continue
        count += 1
    return count


def _rank_slices(
    name: str, module: nn.Module, parts: dict[int | None, QuantTensor | Fp8Tensor]
) -> list[QuantTensor | Fp8Tensor] | None:
    """The QuantTensors of the rows and columns `module` (a Linear) holds, in its row order; None
    when it stays dense (a part missing, padded rows, a slice across a group)."""
    from radixserve.workers.models.linear import FusedLinear, Linear

    assert isinstance(module, Linear)
    wanted: list[tuple[int | None, tuple[int, int] | None]]
    if isinstance(module, FusedLinear):
        wanted = list(enumerate(module.parts))
    else:
        wanted = [(None, module.rows)]
    if any(p not in parts for p, _ in wanted):
        return None  # a part stored in a form without a kernel: the whole module stays dense
    out = []
    for p, rows in wanted:
        qt = parts[p].narrow(rows, module.cols)
        if qt is None:
            log.info("%s: its tensor-parallel slice cuts a quantization group; it stays dense", name)
            return None
        out.append(qt)
    if sum(qt.n for qt in out) != module.out_features:
        return None  # padded rows (a vocabulary split unevenly)
    return out


def _check_same(name: str, got: torch.Tensor, dense: torch.Tensor, remedy: str) -> None:
    if got.shape != dense.shape or not torch.equal(got, dense):
        raise ValueError(f"{name}: the quantized weights differ from the checkpoint's values; {remedy}")


def weight_nbytes(model: nn.Module) -> int:
    """Bytes of a model's weights: its parameters and its quantized weights' tensors (buffers of
    the modules that compute from them), each storage counted once."""
    tensors: list[torch.Tensor] = list(model.parameters())
    for module in model.modules():
        if isinstance(module, QuantWeight) or getattr(module, "quantized", None) is not None:
            tensors += list(module.buffers(recurse=False))
    return sum({t.data_ptr(): t.numel() * t.element_size() for t in tensors}.values())


def use_strips_(model: nn.Module) -> int:
    """Lay every quantized projection of a bf16 `model` out in strips (kernels/quant_ops.StripTensor)
    where their kernel runs (AVX512-BF16; with int8 activations, AVX-512 VNNI too); an embedding
    table that is also the LM head's weight (tied) is replaced by the same strips, so one copy
    serves both. Returns how many projections changed."""
    from radixserve.workers.models.parallel_layers import VocabParallelEmbedding

    if not strips_available():
        return 0
    shared: dict[int, StripTensor] = {}
    count = 0
    for module in model.modules():
        if isinstance(module, QuantWeight) and (not module.int8_activations or strips_int8_available()):
            count += module.use_strips_(True, shared)
    for module in model.modules():
        table = getattr(module, "quantized", None)
        if isinstance(module, VocabParallelEmbedding) and isinstance(table, QuantTensor):
            strip = shared.get(table.qweight.data_ptr())
            if strip is not None:
                module.quantize_(strip)
    return count


def set_activations_(model: nn.Module, activations: str) -> int:
    """How every quantized projection of `model` multiplies decode rows: "float" (exact up to
    summation order) or "int8" (rows rounded to int8 per block of 32, integer products). Returns
    how many projections it set."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
    count = 0
    for module in model.modules():
        if isinstance(module, QuantWeight):
            module.int8_activations = activations == "int8"
            count += 1
    return count
