"""Turns a scheduler plan into tensors on the engine's device and runs the model over the KV pool
(eagerly, or for decode steps on CUDA by replaying a captured graph: executor/cuda_graphs.py)."""

from __future__ import annotations

from typing import Any

import torch

from radixserve.workers.executor.cuda_graphs import DecodeGraphs
from radixserve.workers.executor.plan import BatchKind, ScheduledBatch
from radixserve.workers.models.forward_batch import ForwardBatch


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        pool: Any,
        req_pool: Any,
        device: str | torch.device = "cpu",
        lora: Any = None,
    ):
        self.model = model
        self.lora = lora  # the engine's LoRAManager, when it serves adapters
        self.pool = pool
        self.req_pool = req_pool
        self.device = torch.device(device)
        self.graphs: DecodeGraphs | None = None

    def capture_decode_graphs(self, max_bs: int, eager: bool = False) -> DecodeGraphs:
        """Capture the decode forward for batch sizes up to `max_bs` (CUDA); `eager`: the same
        static buffers and padding, run without graphs (any device)."""
        graphs = DecodeGraphs(self.model, self.pool, max_bs, self.req_pool.max_context, self.device)
        if eager:
            graphs.run_eagerly()
        else:
            graphs.capture()
        self.graphs = graphs
        return graphs

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def prepare(self, plan: ScheduledBatch, extra_rows: list[int] | None = None) -> ForwardBatch:
        """The plan's tensors. The logits rows are each sequence's last new token, then
        `extra_rows` (token rows whose logits are also wanted: prompt logprobs)."""
        ids: list[int] = []
        positions: list[int] = []
        out_slots: list[int] = []
        seq_lens: list[int] = []
        rows: list[int] = []
        t_rows: list[int] = []
        t_cols: list[int] = []
        t_vals: list[int] = []
        decode = plan.kind is BatchKind.DECODE
        # LoRA: each token's adapter slot, only when some sequence of the batch has an adapter.
        lora = self.lora is not None and any(r.lora_slot is not None for r in plan.reqs)
        token_slots: list[int] = []
        for req, start, n in zip(plan.reqs, plan.starts, plan.extend_lens):
            if lora:
                token_slots += [-1 if req.lora_slot is None else req.lora_slot] * n
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
            table[self._tensor(t_rows), self._tensor(t_cols)] = self._tensor(t_vals)
        extend_lens = list(plan.extend_lens)
        kv_indices = table[self._tensor(rows), : max(seq_lens)]
        extend = self._tensor(extend_lens)
        logits_indices = extend.cumsum(0) - 1
        if extra_rows:
            logits_indices = torch.cat([logits_indices, self._tensor(extra_rows)])
        return ForwardBatch(
            kind=plan.kind,
            input_ids=self._tensor(ids),
            positions=self._tensor(positions),
            out_slots=self._tensor(out_slots),
            seq_lens=self._tensor(seq_lens),
            extend_lens=extend,
            kv_indices=kv_indices,
            logits_indices=logits_indices,
            seq_lens_list=seq_lens,
            extend_lens_list=extend_lens,
            lora=self.lora.batch(token_slots, self.device) if lora else None,
        )

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [len(logits_indices), vocab] (float32): at the last new token of each sequence,
        then at the batch's extra rows."""
        if batch.lora is not None:  # the captured graphs run the base model only
            self.lora.ctx.batch = batch.lora
            try:
                return self.model(batch, self.pool)
            finally:
                self.lora.ctx.batch = None
        if self.graphs is not None and self.graphs.fits(batch):
            return self.graphs.run(batch)
        return self.model(batch, self.pool)


def _token_range(req: Any, start: int, end: int) -> list[int]:
    prompt = req.origin_input_ids
    if end <= len(prompt):
        return prompt[start:end]
    return (prompt + req.output_ids)[start:end]
