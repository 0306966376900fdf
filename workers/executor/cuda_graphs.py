"""CUDA graphs of the decode forward: one captured graph per batch-size bucket, replayed in place of
the layer-by-layer launches.

A decode step of a small batch is launch-bound on a GPU: the kernels are short and the host
issues hundreds of them per step. A graph replays them all with one launch. Each bucket's graph
reads its inputs from static buffers, sized for the largest bucket and for the engine's context,
and writes its logits to a static output; a batch of n sequences takes the smallest bucket of at
least n and pads the rest:
- input id and position 0;
- KV written to slot 0, the pool's reserved padding slot;
- a length of 1 over slot 0.
Entries of a row past its sequence length are left from earlier steps: any slot index is valid
there, and attention never reads past a row's length.

What a graph may capture: nothing may be read back to the host during the forward. The dense
models read nothing back; MoE routing does (its expert counts), so those models run eagerly. The
engine captures with the Triton backend only, which reads each row up to its length; the torch
backend reads nothing back either, but its decode gathers a row's whole width, which here is the
whole context. The model's host-side check (the context length) is `fits` here, before each
replay, since a replay skips the Python. Graphs share one memory pool, captured largest first so
the smaller ones fit in its blocks.
"""

from __future__ import annotations

import bisect
import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

from radixserve.workers.batch_kind import BatchKind
from radixserve.workers.models.forward_batch import ForwardBatch

logger = logging.getLogger("radixserve.engine")

WARMUP_RUNS = 2  # before each capture: compiles the Triton kernels, settles the allocator


def graph_buckets(max_bs: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, then every 8 up to max_bs (and max_bs itself)."""
    sizes = [b for b in (1, 2, 4) if b < max_bs] + list(range(8, max_bs, 8)) + [max_bs]
    return sorted(set(sizes))


class DecodeGraphs:
    """Captured decode forwards of `model` over `pool`, batch sizes up to `max_bs`, rows of up to
    `max_context` slots. Built (and captured) on the engine's CUDA device."""

    def __init__(self, model: Any, pool: Any, max_bs: int, max_context: int, device: torch.device):
        self.model, self.pool = model, pool
        self.max_bs, self.max_context = max_bs, max_context
        self.buckets = graph_buckets(max_bs)
        i64 = torch.int64
        self.input_ids = torch.zeros(max_bs, dtype=i64, device=device)
        self.positions = torch.zeros(max_bs, dtype=i64, device=device)
        self.out_slots = torch.zeros(max_bs, dtype=i64, device=device)  # slot 0: the pool's padding slot
        self.seq_lens = torch.ones(max_bs, dtype=i64, device=device)
        self.kv_indices = torch.zeros(max_bs, max_context, dtype=i64, device=device)
        self.logits_indices = torch.arange(max_bs, dtype=i64, device=device)
        # bucket -> its replay: runs the forward over the static buffers, returns the logits
        self.replays: dict[int, Callable[[], torch.Tensor]] = {}
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.replayed = 0

    def _batch(self, bs: int) -> ForwardBatch:
        return ForwardBatch(
            kind=BatchKind.DECODE,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            out_slots=self.out_slots[:bs],
            seq_lens=self.seq_lens[:bs],
            extend_lens=torch.ones(bs, dtype=torch.int64, device=self.seq_lens.device),
            kv_indices=self.kv_indices[:bs],
            logits_indices=self.logits_indices[:bs],
            seq_lens_list=[1] * bs,
            extend_lens_list=[1] * bs,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        mempool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        for bs in reversed(self.buckets):
            batch = self._batch(bs)
            with torch.cuda.stream(stream):
                for _ in range(WARMUP_RUNS):
                    self.model(batch, self.pool)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=mempool, stream=stream):
                out = self.model(batch, self.pool)
            self.graphs.append(graph)
            self.replays[bs] = functools.partial(_replay, graph, out)
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs of the decode forward for batch sizes %s", self.buckets)

    def run_eagerly(self) -> None:
        """No graphs: each bucket's replay runs the model over the static buffers. The padding and
        the buffers behave as with graphs, on any device (their tests run on CPU)."""
        for bs in self.buckets:
            self.replays[bs] = functools.partial(self.model, self._batch(bs), self.pool)

    def fits(self, batch: ForwardBatch) -> bool:
        """Whether `batch` can replay a graph (a decode step of at most max_bs sequences, no
        per-layer callback, rows within the captured width)."""
        return (
            batch.kind is BatchKind.DECODE
            and 0 < batch.batch_size <= self.max_bs
            and batch.layer_done is None
            and batch.kv_indices.shape[1] <= self.max_context
        )

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """The logits [n, vocab] of `batch` (a view of the graph's output, valid until the next
        replay)."""
        n = batch.batch_size
        bs = self.buckets[bisect.bisect_left(self.buckets, n)]
        width = batch.kv_indices.shape[1]  # max(seq_lens): within the captured width (`fits`)
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.out_slots[:n].copy_(batch.out_slots)
        self.seq_lens[:n].copy_(batch.seq_lens)
        self.kv_indices[:n, :width].copy_(batch.kv_indices)
        if bs > n:  # padding rows: token 0 at position 0, written to and reading slot 0
            self.input_ids[n:bs].zero_()
            self.positions[n:bs].zero_()
            self.out_slots[n:bs].zero_()
            self.seq_lens[n:bs].fill_(1)
            self.kv_indices[n:bs, 0].zero_()
        out = self.replays[bs]()
        self.replayed += 1
        return out[:n]


def _replay(graph: torch.cuda.CUDAGraph, out: torch.Tensor) -> torch.Tensor:
    graph.replay()
    return out
