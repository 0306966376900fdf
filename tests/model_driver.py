"""A minimal test-only driver for a model over a KV pool: builds ForwardBatches by hand.

Not the engine: no scheduler, no cache. It owns a KVPool, hands each sequence fresh slots, and runs
prefill (optionally in chunks, optionally several sequences in one batch) and greedy decode.
"""

from __future__ import annotations

import torch

from radixserve.workers.batch_kind import BatchKind
from radixserve.workers.mem_cache.kv_pool import KVPool
from radixserve.workers.models.forward_batch import ForwardBatch


def make_batch(
    kind: BatchKind, new_tokens: list[list[int]], prefix_lens: list[int], slots: list[list[int]]
) -> ForwardBatch:
    """One batch: sequence i has `prefix_lens[i]` cached tokens and `new_tokens[i]` to run.

    `slots[i]` are the KV slots of all of sequence i's positions (prefix + new). Padding entries of
    kv_indices point at slot 0, the pool's reserved dummy slot.
    """
    extend_lens = [len(t) for t in new_tokens]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    width = max(seq_lens)
    kv_indices = torch.zeros(len(new_tokens), width, dtype=torch.int64)
    for i, s in enumerate(slots):
        kv_indices[i, : seq_lens[i]] = torch.tensor(s[: seq_lens[i]])
    positions = [p + j for p, e in zip(prefix_lens, extend_lens) for j in range(e)]
    out_slots = [s[p + j] for s, p, e in zip(slots, prefix_lens, extend_lens) for j in range(e)]
    ends = torch.tensor(extend_lens).cumsum(0)
    return ForwardBatch(
        kind=kind,
        input_ids=torch.tensor([t for ts in new_tokens for t in ts], dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        out_slots=torch.tensor(out_slots, dtype=torch.int64),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
        extend_lens=torch.tensor(extend_lens, dtype=torch.int64),
        kv_indices=kv_indices,
        logits_indices=ends - 1,
        seq_lens_list=seq_lens,
        extend_lens_list=extend_lens,
    )


class ModelDriver:
    def __init__(self, model, config, num_slots: int = 4096):
        self.model = model
        # A tensor-parallel shard caches only its own KV heads.
        kv_heads = getattr(model, "local_kv_heads", config.num_kv_heads)
        self.pool = KVPool(config.num_layers, kv_heads, config.head_dim, num_slots, dtype=config.dtype)

    def greedy(
        self, prompts: list[list[int]], max_new_tokens: int, chunk: int | None = None
    ) -> list[list[int]]:
        """Greedy continuation of every prompt, all sequences batched together.

        Prefill runs all prompts in one EXTEND batch, or with `chunk`, in rounds of at most
        `chunk` tokens per sequence (later rounds attend to the earlier rounds as a prefix).
        """
        slots = [self.pool.alloc(len(p) + max_new_tokens) for p in prompts]
        done = [0] * len(prompts)
        last_logits: dict[int, torch.Tensor] = {}
        while len(last_logits) < len(prompts):
            step = chunk or max(len(p) for p in prompts)
            active = [i for i, p in enumerate(prompts) if done[i] < len(p)]
            pieces = [prompts[i][done[i] : done[i] + step] for i in active]
            batch = make_batch(
                BatchKind.PREFILL, pieces, [done[i] for i in active], [slots[i] for i in active]
            )
            out = self.model(batch, self.pool)
            for row, i in enumerate(active):
                done[i] += len(pieces[row])
                if done[i] == len(prompts[i]):
                    last_logits[i] = out[row]
        outputs = [[int(last_logits[i].argmax())] for i in range(len(prompts))]
        for step in range(1, max_new_tokens):
            lens = [len(p) + step - 1 for p in prompts]
            batch = make_batch(BatchKind.DECODE, [[o[-1]] for o in outputs], lens, slots)
            next_tokens = self.model(batch, self.pool).argmax(dim=-1).tolist()
            for o, t in zip(outputs, next_tokens):
                o.append(int(t))
        for s in slots:
            self.pool.free(s)
        return outputs

    def logits_of(self, tokens: list[int]) -> torch.Tensor:
        """Float32 logits for the next token after `tokens` (one prefill)."""
        slots = self.pool.alloc(len(tokens))
        out = self.model(make_batch(BatchKind.PREFILL, [tokens], [0], [slots]), self.pool)
        self.pool.free(slots)
        return out[0]
