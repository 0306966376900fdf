"""Decode steps of a dense Llama-family model with one native call per decoder layer.

A decode step's layers are a dozen small ops each (norms, projections, rotary, the KV write,
attention); on a CPU the Python between them is a large part of the step (on the default model at
batch 1 about 3 of 7 ms). `FusedDecode` runs each layer through the extension's
`decoder_layer_decode`, which calls the same kernels with the same arguments as the modules do, so
the output is bitwise the Python path's. It applies only where that path would run exactly those
kernels: bf16 weights all on the packed GEMM at the step's row count, no biases, no LoRA, no tensor
parallelism, the plain attention and MLP, the CPU backend outside batch-invariant mode.
"""

from __future__ import annotations

from typing import Any

import torch

from radixserve.kernels import cpu_ops
from radixserve.workers.batch_kind import BatchKind
from radixserve.workers.models.forward_batch import ForwardBatch
from radixserve.workers.models.linear import Linear


class FusedDecode:
    def __init__(
        self, layers: list[tuple[Any, ...]], max_rows: int, heads: int, kv_heads: int, head_dim: int
    ):
        self.layers = layers  # per layer: the kernels' weight arguments
        self.max_rows = max_rows  # the packed GEMM serves fewer rows than this
        self.shape = (heads, kv_heads, head_dim)
        self.native = cpu_ops.native_ops()

    @classmethod
    def build(cls, model: Any) -> FusedDecode | None:
        """The fused path of a loaded (packed) model, or None where it would not run the same
        kernels as the modules. Call after everything that wraps the layers (LoRA) is attached."""
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
        layers: list[tuple[Any, ...]] = []
        linears_all: list[Linear] = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if type(mlp) is not LlamaMLP:
                return None
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if not all(_plain_packed(m) for m in linears):
                return None
            if mlp.gate_up_proj.out_features != 2 * mlp.down_proj.in_features:
                return None  # the kernel takes gate | up halves of the down projection's width
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if norms[0].eps != norms[1].eps or any(n.weight.dtype != torch.bfloat16 for n in norms):
                return None
            layers.append(
                (
                    norms[0].weight,
                    norms[1].weight,
                    norms[0].eps,
                    attn.qkv_proj.packed_weight,
                    attn.o_proj.packed_weight,
                    mlp.gate_up_proj.packed_weight,
                    mlp.gate_up_proj.out_features,
                    mlp.down_proj.packed_weight,
                )
            )
            linears_all += linears
        if not layers:
            return None
        first = model.model.layers[0].self_attn
        max_rows = min(m.packed_below for m in linears_all)
        return cls(layers, max_rows, first.num_heads, first.num_kv_heads, first.head_dim)

    def usable(self, batch: ForwardBatch, kv_pool: Any) -> bool:
        return (
            batch.kind is BatchKind.DECODE
            and batch.lora is None
            and batch.num_tokens < self.max_rows
            and kv_pool.k_buffers[0].dtype == torch.bfloat16
        )

    def run(
        self, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch, kv_pool: Any
    ) -> torch.Tensor:
        """Every layer over `residual` (the embeddings, updated in place); returns the last
        layer's MLP output, which the final norm adds to the residual."""
        assert batch.attn_metadata is not None, "the backend prepares the batch first"
        kv_indices, seq_lens = batch.attn_metadata
        heads, kv_heads, head_dim = self.shape
        layer_done = batch.layer_done
        delta = None
        for i, (in_norm, post_norm, eps, qkv, o, gate_up, gate_up_n, down) in enumerate(self.layers):
            delta = self.native.decoder_layer_decode(
                delta,
                residual,
                in_norm,
                post_norm,
                eps,
                qkv,
                o,
                gate_up,
                gate_up_n,
                down,
                cos,
                sin,
                kv_pool.k_buffers[i],
                kv_pool.v_buffers[i],
                batch.out_slots,
                kv_indices,
                seq_lens,
                heads,
                kv_heads,
                head_dim,
            )
            if layer_done is not None:
                layer_done(i)
        assert delta is not None
        return delta


def _plain_packed(m: Linear) -> bool:
    return (
        m.packed
        and not m.fixed_order
        and m.quantized is None
        and m.lora is None
        and m.bias_f32 is None
        and m.packed_weight.dtype == torch.bfloat16
    )
