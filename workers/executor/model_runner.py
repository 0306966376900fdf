"""Turns a scheduler plan into tensors, runs the model over the KV pool, and samples."""

from __future__ import annotations

from typing import Any

import torch

from radixserve.workers.executor.plan import BatchKind, ScheduledBatch
from radixserve.workers.models.forward_batch import ForwardBatch, ForwardMode


class ModelRunner:
    def __init__(self, model: torch.nn.Module, pool: Any, req_pool: Any, device: str = "cpu"):
        self.model = model
        self.pool = pool
        self.req_pool = req_pool
        self.device = device

    def prepare(self, plan: ScheduledBatch) -> ForwardBatch:
        ids: list[int] = []
        positions: list[int] = []
        out_slots: list[int] = []
        seq_lens: list[int] = []
        rows: list[int] = []
        t_rows: list[int] = []
        t_cols: list[int] = []
        t_vals: list[int] = []
        decode = plan.kind is BatchKind.DECODE
        for req, start, n in zip(plan.reqs, plan.starts, plan.extend_lens):
            end = start + n
            row = req.row
            assert row is not None, "a scheduled request holds a table row"
            if decode:
                ids.append(req.output_ids[-1] if req.output_ids else req.origin_input_ids[-1])
                positions.append(start)
            else:
                ids.extend(_token_range(req, start, end))
                positions.extend(range(start, end))
            out_slots.extend(req.kv_slots[start:end])
            seq_lens.append(end)
            rows.append(row)
            # Sync the request's table row with its slot list (only the new part, usually).
            new = req.kv_slots[req.table_len : end]
            t_rows.extend([row] * len(new))
            t_cols.extend(range(req.table_len, end))
            t_vals.extend(new)
            req.table_len = end
        table = self.req_pool.table
        if t_vals:
            table[torch.tensor(t_rows), torch.tensor(t_cols)] = torch.tensor(t_vals, dtype=table.dtype)
        extend_lens = list(plan.extend_lens)
        kv_indices = table[torch.tensor(rows), : max(seq_lens)]
        cu = torch.tensor(extend_lens).cumsum(0)
        return ForwardBatch(
            mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            out_slots=torch.tensor(out_slots, dtype=torch.int64),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
            extend_lens=torch.tensor(extend_lens, dtype=torch.int64),
            kv_indices=kv_indices.to(torch.int64),
            logits_indices=cu - 1,
            seq_lens_list=seq_lens,
            extend_lens_list=extend_lens,
        )

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [B, vocab] (float32) at the last new token of each sequence."""
        return self.model(batch, self.pool)


def _token_range(req: Any, start: int, end: int) -> list[int]:
    prompt = req.origin_input_ids
    if end <= len(prompt):
        return prompt[start:end]
    return (prompt + req.output_ids)[start:end]
