"""Decode steps of a dense Llama-family model with its decoder layers in one native call.

A decode step's layers are a dozen small ops each (norms, projections, rotary, the KV write,
attention); on a CPU the Python between them is a large part of the step (on the default model at
batch 1 about 3 of 7 ms). `FusedDecode` runs the layers through the extension's `DecodeStack`,
which calls the same kernels with the same arguments as the modules do, so the output is bitwise
the Python path's. It applies only where that path would run exactly those kernels: every
projection on the packed bf16 GEMM or on a quantized kernel (one layout, the step's row count
below its dequantize crossover), no biases, no LoRA, no tensor parallelism, the plain attention
and MLP, the CPU backend outside batch-invariant mode.
"""

from __future__ import annotations

from typing import Any

import torch

from radixserve.kernels import cpu_ops
from radixserve.kernels.quant_ops import DEQUANT_ROWS, STRIP_DEQUANT_ROWS, QuantTensor, StripTensor
from radixserve.workers.batch_kind import BatchKind
from radixserve.workers.models.forward_batch import ForwardBatch
from radixserve.workers.models.linear import Linear
from radixserve.workers.models.quant_weight import QuantWeight


class FusedDecode:
    def __init__(self, stack: Any, num_layers: int, max_rows: int, dtype: torch.dtype):
        self.stack = stack  # the extension's DecodeStack
        self.num_layers = num_layers
        self.max_rows = max_rows  # every projection runs its decode kernel below this many rows
        self.dtype = dtype  # the activations' (and the KV pool's) dtype

    @classmethod
    def build(cls, model: Any) -> FusedDecode | None:
        """The fused path of a loaded (packed or quantized) model, or None where it would not run
        the same kernels as the modules. Call after everything that wraps the layers (LoRA) is
        attached."""
        from radixserve.workers.models.attention import CpuBackend
        from radixserve.workers.models.llama import LlamaAttention, LlamaMLP

        if (
            type(model.backend) is not CpuBackend  # first: a GPU process never builds the extension
            or model.backend.batch_invariant
            or model.parallel.tp_size != 1
            or type(model).attention_cls.prepare_qk is not LlamaAttention.prepare_qk
            or cpu_ops.native_ops() is None
        ):
            return None
        native = cpu_ops.native_ops()
        layers: list[Any] = []
        max_rows: list[int] = []
        dtype: torch.dtype | None = None
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if type(mlp) is not LlamaMLP:
                return None
            if mlp.gate_up_proj.out_features != 2 * mlp.down_proj.in_features:
                return None  # the kernel takes gate | up halves of the down projection's width
            found = [
                _decode_linear(native, m)
                for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            ]
            projections = [p for p in found if p is not None]
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            dtype = dtype or norms[0].weight.dtype
            if (
                len(projections) < len(found)
                or norms[0].eps != norms[1].eps
                or any(n.weight.dtype != dtype for n in norms)
                or dtype not in (torch.bfloat16, torch.float32)
            ):
                return None
            max_rows += [rows for _, rows in projections]
            weights = [linear for linear, _ in projections]
            layers.append(native.DecodeLayer(norms[0].weight, norms[1].weight, norms[0].eps, *weights))
        if not layers or dtype is None:
            return None
        first = model.model.layers[0].self_attn
        stack = native.DecodeStack(layers, first.num_heads, first.num_kv_heads, first.head_dim)
        return cls(stack, len(layers), min(max_rows), dtype)

    def usable(self, batch: ForwardBatch, kv_pool: Any) -> bool:
        return (
            batch.kind is BatchKind.DECODE
            and batch.lora is None
            and batch.num_tokens < self.max_rows
            and (
                kv_pool.k_buffers[0].dtype == self.dtype
                or (kv_pool.quantized and self.dtype == torch.bfloat16)  # the int8 pool's kernels
            )
        )

    def run(
        self, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch, kv_pool: Any
    ) -> torch.Tensor:
        """Every layer over `residual` (the embeddings, updated in place); returns the last
        layer's MLP output, which the final norm adds to the residual. All layers in one call,
        or one at a time where the batch reports each finished layer (layer-by-layer KV
        transfer)."""
        assert batch.attn_metadata is not None, "the backend prepares the batch first"
        kv_indices, seq_lens = batch.attn_metadata
        args = (cos, sin, kv_pool.k_buffers, kv_pool.v_buffers, batch.out_slots, kv_indices, seq_lens)
        layer_done = batch.layer_done
        if layer_done is None:
            return self.stack.run(0, self.num_layers, None, residual, *args)
        delta = None
        for i in range(self.num_layers):
            delta = self.stack.run(i, i + 1, delta, residual, *args)
            layer_done(i)
        assert delta is not None
        return delta


def _decode_linear(native: Any, m: Linear) -> tuple[Any, int] | None:
    """(the extension's DecodeLinear for `m`, the rows below which it runs that kernel), or None
    where `m` computes otherwise (bias, LoRA, a mix of quantized layouts, fp8, the dense GEMM)."""
    if m.lora is not None or m.bias_f32 is not None:
        return None
    q = m.quantized
    if q is None:
        if m.packed and not m.fixed_order and m.packed_weight.dtype == torch.bfloat16:
            return native.DecodeLinear(m.packed_weight, m.out_features), m.packed_below
        return None
    if type(q) is not QuantWeight or len(q.parts) != 1 or q.bias_f32 is not None:
        return None
    part = q.parts[0]
    if isinstance(part, StripTensor):
        strips = native.DecodeLinear(
            part.data, part.n, part.scale, part.offset, part.group, part.bits, q.int8_activations, strips=True
        )
        return strips, STRIP_DEQUANT_ROWS
    if not isinstance(part, QuantTensor) or part.qweight.device.type != "cpu":
        return None
    linear = native.DecodeLinear(
        part.qweight, part.n, part.scale, part.offset, part.group, part.bits, q.int8_activations
    )
    return linear, DEQUANT_ROWS[part.bits]
