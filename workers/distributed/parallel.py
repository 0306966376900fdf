"""Tensor and expert parallel layout: which slice of every weight a rank holds.

Layout (as SGLang's --tp / --ep-size): `tp_size` ranks form one tensor-parallel group.
- Attention: query heads split across the ranks in whole GQA groups (a KV head and its query
  heads stay together). With fewer KV heads than ranks, each KV head is replicated on
  tp_size / num_kv_heads ranks that split its query heads. With more, ranks hold whole KV heads,
  unevenly where they do not divide (9 query / 3 KV heads on 2 ranks: 6 + 3 query heads).
- Dense MLP: the intermediate dimension split evenly (within one row where it does not divide).
- Vocabulary: the embedding and the LM head split in equal row blocks (the last one padded).
- MoE: the ranks form ep_size expert groups of moe_tp_size = tp_size / ep_size consecutive ranks.
  Expert group g holds experts [g * E / ep_size, (g + 1) * E / ep_size) and splits each of them
  across its moe_tp_size ranks by intermediate dimension. Every rank sees every token (the
  attention's all-reduce leaves the hidden states replicated), runs only its experts' slices, and
  one all-reduce over all tp_size ranks sums the MoE block's output, as it does a dense MLP's.
  Sending each token only to its experts' ranks (all-to-all) would then need three all-to-alls
  plus an all-gather to replicate the tokens again for the next attention: on the 2-core dev VM
  (load_tests/bench_moe_dispatch.py, 2 ranks, Gloo, three runs) that took 1.1-3x the
  all-reduce's time per block at 1, 16 and 256 tokens per rank (0.44 vs 1.26 ms at 1 token). With tokens partitioned over the ranks instead, the
  all-to-all and an all-gather + reduce-scatter measured within noise of each other.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.workers.distributed.group import CommGroup


def shard_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """[lo, hi) of part `index` when `total` items are split in `parts` contiguous, balanced parts
    (the first total % parts parts one larger)."""
    base, extra = divmod(total, parts)
    lo = index * base + min(index, extra)
    return lo, lo + base + (1 if index < extra else 0)


def padded_range(total: int, parts: int, index: int) -> tuple[int, int, int]:
    """(lo, hi, block): part `index` of equal blocks of ceil(total / parts) items; the items it
    holds are [lo, hi), and hi - lo < block only in the last (padded) part."""
    block = -(-total // parts)
    lo = min(index * block, total)
    return lo, min(lo + block, total), block


@dataclass(frozen=True)
class HeadSplit:
    """The attention heads of one rank: query heads [q_lo, q_hi), KV heads [kv_lo, kv_hi)."""

    q_lo: int
    q_hi: int
    kv_lo: int
    kv_hi: int

    @property
    def num_heads(self) -> int:
        return self.q_hi - self.q_lo

    @property
    def num_kv_heads(self) -> int:
        return self.kv_hi - self.kv_lo

    @classmethod
    def of(cls, num_heads: int, num_kv_heads: int, tp_size: int, tp_rank: int) -> HeadSplit:
        group = num_heads // num_kv_heads
        if num_kv_heads >= tp_size:
            kv_lo, kv_hi = shard_range(num_kv_heads, tp_size, tp_rank)
            return cls(kv_lo * group, kv_hi * group, kv_lo, kv_hi)
        replicas = tp_size // num_kv_heads
        if tp_size % num_kv_heads or group % replicas:
            raise ValueError(
                f"cannot split {num_heads} query heads / {num_kv_heads} KV heads over {tp_size} ranks: "
                f"with fewer KV heads than ranks, the ranks must be a multiple of the KV heads and "
                f"each KV head's {group} query heads a multiple of its {replicas} replicas"
            )
        kv = tp_rank // replicas
        per_rank = group // replicas
        q_lo = kv * group + (tp_rank % replicas) * per_rank
        return cls(q_lo, q_lo + per_rank, kv, kv + 1)


@dataclass(frozen=True)
class ParallelConfig:
    """The parallel sizes: the same on every rank of a replica."""

    tp_size: int = 1
    ep_size: int = 1

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.ep_size < 1:
            raise ValueError(f"tp_size and ep_size must be >= 1, got {self.tp_size} and {self.ep_size}")
        if self.tp_size % self.ep_size:
            raise ValueError(
                f"ep_size ({self.ep_size}) must divide tp_size ({self.tp_size}): expert groups are "
                "made of the tensor-parallel ranks"
            )

    @property
    def moe_tp_size(self) -> int:
        return self.tp_size // self.ep_size

    def ep_rank(self, tp_rank: int) -> int:
        """The expert group of a rank: consecutive blocks of moe_tp_size ranks."""
        return tp_rank // self.moe_tp_size

    def moe_tp_rank(self, tp_rank: int) -> int:
        """A rank's place in its expert group: which slice of each expert it holds."""
        return tp_rank % self.moe_tp_size

    def check_model(self, num_heads: int, num_kv_heads: int, num_experts: int) -> None:
        """Raise ValueError, before any rank is started, if a model with these heads and experts
        (0: a dense model) has no layout over these sizes."""
        for rank in range(self.tp_size):
            HeadSplit.of(num_heads, num_kv_heads, self.tp_size, rank)
        if self.ep_size > 1 and not num_experts:
            raise ValueError(f"ep_size {self.ep_size} needs a mixture-of-experts model; this one is dense")
        if num_experts:
            self.experts(num_experts, 0)

    def experts(self, num_experts: int, tp_rank: int) -> range:
        """The expert ids whose (slices of) weights rank `tp_rank` holds."""
        if num_experts < self.ep_size:
            raise ValueError(f"{num_experts} experts cannot be spread over ep_size {self.ep_size}")
        return range(*shard_range(num_experts, self.ep_size, self.ep_rank(tp_rank)))


@dataclass(frozen=True)
class Parallel:
    """What a model shard needs: the sizes and this rank's group (tp_rank = group.rank)."""

    config: ParallelConfig
    group: CommGroup

    def __post_init__(self) -> None:
        if self.group.world_size != self.config.tp_size:
            raise ValueError(
                f"the group has {self.group.world_size} ranks, the config tp_size {self.config.tp_size}"
            )

    @classmethod
    def single(cls) -> Parallel:
        return cls(ParallelConfig(), CommGroup.single())

    @property
    def tp_rank(self) -> int:
        return self.group.rank

    @property
    def tp_size(self) -> int:
        return self.config.tp_size

    @property
    def ep_rank(self) -> int:
        return self.config.ep_rank(self.tp_rank)

    @property
    def moe_tp_rank(self) -> int:
        return self.config.moe_tp_rank(self.tp_rank)

    def heads(self, num_heads: int, num_kv_heads: int) -> HeadSplit:
        return HeadSplit.of(num_heads, num_kv_heads, self.tp_size, self.tp_rank)

    def experts(self, num_experts: int) -> range:
        return self.config.experts(num_experts, self.tp_rank)
