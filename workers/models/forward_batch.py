"""What one forward pass needs: built by the model runner, read by the model and attention kernels."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from radixserve.workers.batch_kind import BatchKind


@dataclass
class ForwardBatch:
    """Tensors for one step over B sequences and T new tokens (T == B in decode).

    New tokens of sequence i occupy rows [cu_extend[i], cu_extend[i+1]) of input_ids/positions.
    `kv_indices[i, :seq_lens[i]]` are the KV pool slots of every position of sequence i, the new
    tokens included (their K/V are written to `out_slots` before attention reads them); entries past
    `seq_lens[i]` are arbitrary valid slots and must be masked out.
    """

    kind: BatchKind
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_slots: torch.Tensor  # [T] int64: where each new token's K/V is written
    seq_lens: torch.Tensor  # [B] int64: KV length after this step (prefix + new)
    extend_lens: torch.Tensor  # [B] int64: new tokens per sequence
    kv_indices: torch.Tensor  # [B, max(seq_lens)] int64
    # [B + E] int64: rows of T whose logits are returned, each sequence's last new token first,
    # then E more (prompt logprobs: executor/input_logprobs.py)
    logits_indices: torch.Tensor
    seq_lens_list: list[int] = field(default_factory=list)
    extend_lens_list: list[int] = field(default_factory=list)
    # Scratch space an attention backend fills once per batch (masks, offsets) and reuses
    # across layers.
    attn_metadata: Any | None = None
    # Called with i once decoder layer i has run, its K/V for this batch written (queued, on a
    # device) to the pool: PD's prefill side starts sending that layer while the next ones run.
    layer_done: Callable[[int], None] | None = None
    # The LoRA adapter slots of the batch's tokens (lora/layers.py LoRABatch); None: base model only.
    lora: Any | None = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_list)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def prefix_lens_list(self) -> list[int]:
        return [s - e for s, e in zip(self.seq_lens_list, self.extend_lens_list)]

    @property
    def cu_extend(self) -> list[int]:
        out = [0]
        for n in self.extend_lens_list:
            out.append(out[-1] + n)
        return out
