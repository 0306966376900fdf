"""Mixtral: the Llama decoder with a sparse MoE block (top-2 of 8 experts, weights renormalized)
as every layer's MLP.

Its checkpoints name the block `block_sparse_moe` and an expert's projections w1 (gate), w3 (up)
and w2 (down); they are read under the names the shared MoE block uses.
"""

from __future__ import annotations

import re

from torch import nn

from radixserve.workers.distributed.parallel import Parallel
from radixserve.workers.models.config import ModelConfig
from radixserve.workers.models.llama import LlamaForCausalLM
from radixserve.workers.models.moe import SparseMoeBlock

_EXPERT_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_EXPERT_NAME = re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.")


class MixtralForCausalLM(LlamaForCausalLM):
    graph_capturable = False  # routing reads the expert counts back

    @staticmethod
    def make_mlp(config: ModelConfig, layer_id: int, parallel: Parallel) -> nn.Module:
        return SparseMoeBlock(config, parallel, weights_in_float32=True)

    @staticmethod
    def checkpoint_name(name: str) -> str:
        name = _EXPERT_NAME.sub(lambda m: f".mlp.experts.{m[1]}.{_EXPERT_PROJ[m[2]]}.", name)
        return name.replace(".block_sparse_moe.gate.", ".mlp.gate.")
