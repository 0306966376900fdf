"""What two replicas must agree on before exchanging KV pages: the handshake's content.

A prefill replica and a decode replica can only share KV if the bytes mean the same thing on both
sides: the same model weights, the same cache dtype and head layout, the same page size and the
same transport. `KVSpec` carries exactly those fields; `check_peer` compares two of them and names
every differing field with both sides' values.

A tensor-parallel rank's pool holds only the model's KV heads [kv_head_begin, kv_head_end): two
ranks of replicas of different degrees hold different ranges, which the handshake does not
compare (each transfer names the heads it moves, and both ends check them against their own).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.workers.disaggregation.errors import HandshakeMismatch
from radixserve.workers.mem_cache.kv_pool import KVPool

TRANSPORTS = ("gloo", "nccl", "ray")
# Bumped when the frame protocol changes incompatibly: an old and a new replica refuse each other.
PROTOCOL_VERSION = 2
# Where the ranks of two replicas may differ: each transfer's heads are checked instead.
RANK_FIELDS = ("kv_head_begin", "kv_head_end")


@dataclass(frozen=True)
class KVSpec:
    served_model_name: str
    fingerprint: str  # model_fingerprint(): weights and config, sampled
    dtype: str  # torch dtype name without the "torch." prefix
    page_size: int
    num_layers: int
    num_kv_heads: int  # the model's
    head_dim: int
    transport: str
    protocol_version: int = PROTOCOL_VERSION
    # This pool's share of the model's KV heads (all of them without tensor parallelism).
    kv_head_begin: int = 0
    kv_head_end: int = 0

    def __post_init__(self):
        if self.transport not in TRANSPORTS:
            raise ValueError(f"unknown KV transport {self.transport!r}; expected one of {TRANSPORTS}")
        for name in ("page_size", "num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"KVSpec.{name} must be a positive integer, got {value!r}")
        if not self.kv_head_end:
            object.__setattr__(self, "kv_head_end", self.num_kv_heads)
        if not 0 <= self.kv_head_begin < self.kv_head_end <= self.num_kv_heads:
            raise ValueError(
                f"KVSpec KV heads [{self.kv_head_begin}, {self.kv_head_end}) are not within the model's "
                f"{self.num_kv_heads}"
            )

    @classmethod
    def for_pool(
        cls,
        pool: KVPool,
        served_model_name: str,
        fingerprint: str,
        transport: str,
        kv_heads: tuple[int, int, int] | None = None,
    ) -> KVSpec:
        """The spec of `pool`'s layout, as a replica serving `served_model_name` announces it.
        `kv_heads` = (begin, end, the model's): the heads the pool holds, when not all of them."""
        _, heads, dim = pool.k_buffers[0].shape
        begin, end, total = kv_heads or (0, int(heads), int(heads))
        if end - begin != heads:
            raise ValueError(f"KV heads [{begin}, {end}) for a pool of {heads} heads")
        return cls(
            served_model_name=served_model_name,
            fingerprint=fingerprint,
            dtype=dtype_name(pool.dtype),
            page_size=pool.page_size,
            num_layers=len(pool.k_buffers),
            num_kv_heads=total,
            head_dim=int(dim),
            transport=transport,
            kv_head_begin=begin,
            kv_head_end=end,
        )

    @property
    def kv_heads(self) -> tuple[int, int]:
        return self.kv_head_begin, self.kv_head_end

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if self.kv_heads == (0, self.num_kv_heads):  # every head: what a version-1 peer can read
            del d["kv_head_begin"], d["kv_head_end"]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> KVSpec:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown KVSpec field(s): {', '.join(unknown)}")
        return cls(**d)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def spec_mismatches(local: KVSpec, remote: KVSpec) -> dict[str, tuple[Any, Any]]:
    """Every field on which the two specs differ: {field: (local value, remote value)}."""
    out = {}
    for f in dataclasses.fields(KVSpec):
        if f.name in RANK_FIELDS:
            continue
        a, b = getattr(local, f.name), getattr(remote, f.name)
        if a != b:
            out[f.name] = (a, b)
    return out


def check_peer(local: KVSpec, remote: KVSpec, local_name: str, remote_name: str) -> None:
    """Raise HandshakeMismatch naming each differing field with both sides' values."""
    fields = spec_mismatches(local, remote)
    if fields:
        parts = [f"{k}: {local_name} has {a!r}, {remote_name} has {b!r}" for k, (a, b) in fields.items()]
        raise HandshakeMismatch("KV transfer handshake refused: " + "; ".join(parts), fields)


def model_fingerprint(
    config: Mapping[str, Any], named_tensors: Iterable[tuple[str, torch.Tensor]], samples: int = 64
) -> str:
    """A cheap identity of a model: its config plus every tensor's name, shape, dtype and `samples`
    evenly strided elements. Two checkpoints that differ in any sampled value, any shape or any
    config key get different fingerprints; reading a few elements per tensor keeps this at
    milliseconds for any model size (a full hash would read every weight byte).
    """
    h = hashlib.sha256()
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    for name, t in sorted(named_tensors, key=lambda item: item[0]):
        flat = t.detach().reshape(-1)
        step = max(1, flat.numel() // samples)
        picked = flat[::step][:samples].to("cpu").contiguous()
        h.update(f"{name}|{tuple(t.shape)}|{dtype_name(t.dtype)}|".encode())
        h.update(picked.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:32]
