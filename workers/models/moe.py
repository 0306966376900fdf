"""Sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral): a router and expert MLPs.

Under expert / tensor parallelism (workers/distributed/parallel.py) a rank holds its expert
group's experts, each cut to its slice of the intermediate features. Every rank routes every token
(the router is replicated and the hidden states are the same on all ranks), runs the tokens routed
to its experts, and one all-reduce over the tensor-parallel group sums the block's output.

Each token's router logits go through a float32 softmax; its `top_k` most probable experts run on
it and their outputs are summed, weighted by those probabilities (renormalized to sum 1 where the
model says so). An expert is a Llama MLP of the expert width. Tokens are grouped by expert with one
stable sort, so every expert runs one GEMM pair over all of its tokens, experts in id order and
tokens in batch order as Hugging Face accumulates them.
"""

from __future__ import annotations

import torch
from torch import nn

from radixserve.workers.distributed.parallel import Parallel
from radixserve.workers.models.config import ModelConfig
from radixserve.workers.models.linear import linear
from radixserve.workers.models.llama import LlamaMLP


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] router logits -> float32 weights [T, top_k] and expert ids [T, top_k]."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class SparseMoeBlock(nn.Module):
    """`gate` (the router, hidden -> experts) and `experts`, keyed by expert id as checkpoints
    name them (`mlp.experts.7.down_proj.weight`): the ids this rank holds.

    weights_in_float32: multiply expert outputs by float32 routing weights (Mixtral) rather than
    weights rounded to the model dtype first (Qwen3-MoE); the two differ only below float32.
    """

    def __init__(self, config: ModelConfig, parallel: Parallel, weights_in_float32: bool):
        super().__init__()
        moe = config.moe
        if moe is None:
            raise ValueError(f"{config.architecture} has no MoE configuration")
        self.num_experts, self.top_k, self.renormalize = moe.num_experts, moe.top_k, moe.norm_topk_prob
        self.weights_in_float32 = weights_in_float32
        self.gate = linear(config.hidden_size, moe.num_experts, False, config.dtype)
        self.group = parallel.group
        self.local_experts = parallel.experts(moe.num_experts)
        self.experts = nn.ModuleDict(
            {
                str(e): LlamaMLP(config, parallel, expert_size=moe.intermediate_size)
                for e in self.local_experts
            }
        )

    def holds_expert(self, expert_id: int) -> bool:
        return expert_id in self.local_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.partial(x))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the block's output: its experts' slices, for the tokens routed to
        them (zeros elsewhere); summed over the tensor-parallel group, the block's output."""
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        if not self.weights_in_float32:
            weights = weights.to(x.dtype)
        flat_ids = ids.flatten()
        order = torch.argsort(flat_ids, stable=True)
        tokens = order // self.top_k  # the token of each (token, choice) pair, grouped by expert
        pair_weights = weights.flatten()[order].unsqueeze(1)
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        out = torch.zeros_like(x)
        start = sum(counts[: self.local_experts.start])
        for expert_id in self.local_experts:
            rows = slice(start, start + counts[expert_id])
            start = rows.stop
            if rows.stop > rows.start:
                y = self.experts[str(expert_id)](x.index_select(0, tokens[rows]))
                out.index_add_(0, tokens[rows], (y * pair_weights[rows]).to(x.dtype))
        return out
