"""`KVPeer`: one replica's KV pool and transfer engine inside a Ray actor, driven by the KV
transfer tests. Each actor is its own process, so transfers cross real process boundaries (and
real sockets or the real object store); a test kills or stops an actor's process to exercise
peer failures."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import uuid
import zlib
from typing import Any

import ray
import torch

from radixserve.workers.disaggregation import (
    KVSpec,
    KVTicket,
    KVTransferConfig,
    KVTransferEngine,
)
from radixserve.workers.disaggregation.dist_transport import TorchDistTransferEngine
from radixserve.workers.mem_cache.kv_pool import KVPool

LAYERS, HEADS, DIM = 4, 3, 8
# Liveness fast enough for the death and stall tests, with room for a loaded 2-core machine whose
# actor threads can go seconds without the GIL (a 3 s peer timeout broke healthy pairs there).
TEST_CONFIG = dict(
    op_timeout=6.0, connect_timeout=10.0, heartbeat_interval=0.5, peer_timeout=6.0, transfer_timeout=30.0
)


def make_engine(
    replica_id: str,
    transport: str = "gloo",
    layers: int = LAYERS,
    heads: int = HEADS,
    dim: int = DIM,
    slots: int = 1024,
    dtype: str = "bfloat16",
    page_size: int = 1,
    spec_overrides: dict[str, Any] | None = None,
    config: dict[str, Any] | None = None,
) -> KVTransferEngine:
    pool = KVPool(layers, heads, dim, num_slots=slots, dtype=getattr(torch, dtype), page_size=page_size)
    gen = torch.Generator().manual_seed(zlib.crc32(replica_id.encode()))
    for buf in pool.k_buffers + pool.v_buffers:
        buf[page_size:].copy_(torch.randn(buf[page_size:].shape, generator=gen))
    spec = KVSpec.for_pool(pool, "smollm2", "f" * 32, transport)
    spec = dataclasses.replace(spec, **(spec_overrides or {}))
    cfg = KVTransferConfig(**{**TEST_CONFIG, **(config or {})})
    if transport == "ray":
        from radixserve.workers.disaggregation.ray_transport import RayTransferEngine

        return RayTransferEngine(pool, spec, replica_id, cfg)
    return TorchDistTransferEngine(pool, spec, replica_id, cfg)


class KVPeer:
    """Engines by name (usually one; handshake tests keep several variants in one process)."""

    def __init__(self, replica_id: str, **kwargs):
        self.engines = {"main": make_engine(replica_id, **kwargs)}
        self.handles: dict[str, Any] = {}
        self._lock = threading.Lock()

    def ensure_engine(self, name: str, replica_id: str, **kwargs) -> None:
        """Add an engine (its own pool) under `name` unless there is one already."""
        if name not in self.engines:
            self.engines[name] = make_engine(replica_id, **kwargs)

    def pid(self) -> int:
        return os.getpid()

    def alloc(self, n: int, engine: str = "main") -> list[int]:
        slots = self.engines[engine].pool.alloc(n)
        assert slots is not None
        return slots

    def free(self, slots: list[int], engine: str = "main") -> None:
        self.engines[engine].pool.free(slots)

    def read(self, slots: list[int], engine: str = "main") -> torch.Tensor:
        """K/V of `slots` as [layers, 2, n, heads, dim] in the pool's dtype."""
        pool = self.engines[engine].pool
        idx = torch.tensor(slots, dtype=torch.int64)
        return torch.stack([torch.stack([k[idx], v[idx]]) for k, v in zip(pool.k_buffers, pool.v_buffers)])

    def whole_pool(self, engine: str = "main") -> torch.Tensor:
        pool = self.engines[engine].pool
        return torch.stack([torch.stack([k, v]) for k, v in zip(pool.k_buffers, pool.v_buffers)]).clone()

    def expect(
        self, tid: str, slots: list[int], held: int = 0, timeout: float | None = None, engine: str = "main"
    ):
        handle = self.engines[engine].expect(tid, slots, held_tokens=held, timeout=timeout)
        with self._lock:
            self.handles[tid] = handle
        return handle.ticket.to_dict()

    def start(self, ticket: dict, src: list[int], engine: str = "main") -> None:
        handle = self.engines[engine].send(KVTicket.from_dict(ticket), src)
        with self._lock:
            self.handles[handle.transfer_id] = handle

    def send_layers(self, tid: str, layer_begin: int, layer_end: int, token_begin: int = 0, token_end=None):
        self.handles[tid].send_layers(layer_begin, layer_end, token_begin, token_end)

    def send(
        self, ticket: dict, src: list[int], mode: str = "all", chunk: int = 0, engine: str = "main"
    ) -> None:
        """Start and finish a transfer: whole request ("all"), layer by layer ("layers"), or
        chunk by chunk of `chunk` tokens with every layer per chunk ("chunks")."""
        self.start(ticket, src, engine)
        handle = self.handles[ticket["transfer_id"]]
        layers = self.engines[engine].view.num_layers
        if mode == "all":
            handle.send_all()
        elif mode == "layers":
            for layer in range(layers):
                handle.send_layers(layer, layer + 1)
        else:
            for tb in range(0, handle.num_tokens, chunk):
                for layer in range(layers):
                    handle.send_layers(layer, layer + 1, tb, min(tb + chunk, handle.num_tokens))
        handle.finish()

    def send_interleaved(self, tickets: list[dict], srcs: list[list[int]]) -> None:
        """Several transfers over one pair at once: layer l of every transfer before layer l + 1."""
        handles = []
        for ticket, src in zip(tickets, srcs):
            self.start(ticket, src)
            handles.append(self.handles[ticket["transfer_id"]])
        for layer in range(self.engines["main"].view.num_layers):
            for handle in handles:
                handle.send_layers(layer, layer + 1)
        for handle in handles:
            handle.finish()

    def finish(self, tid: str) -> None:
        self.handles[tid].finish()

    def cancel(self, tid: str) -> bool:
        return self.handles[tid].cancel()

    def outcome(self, tid: str, timeout: float = 30.0) -> str:
        """'' once the transfer succeeded, else "<ErrorType>: <message>"; "pending" past `timeout`."""
        handle = self.handles[tid]
        try:
            handle.future.result(timeout)
        except TimeoutError:
            return "pending"
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return ""

    def error_fields(self, tid: str) -> dict:
        return dict(getattr(self.handles[tid].future.exception(), "fields", {}))

    def endpoint(self, engine: str = "main") -> dict:
        return self.engines[engine].endpoint().to_dict()

    def stats(self, engine: str = "main") -> dict:
        return self.engines[engine].stats_snapshot()

    def refusals(self, engine: str = "main") -> list[str]:
        return list(self.engines[engine].refusals)

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()


# -- driver-side helpers ---------------------------------------------------------------------

# (field, make_engine arguments of a sender that differs in it, its value, the receiver's value)
SPEC_MISMATCHES = [
    ("served_model_name", {"spec_overrides": {"served_model_name": "other-model"}}, "other-model", "smollm2"),
    ("fingerprint", {"spec_overrides": {"fingerprint": "0" * 32}}, "0" * 32, "f" * 32),
    ("dtype", {"dtype": "float32"}, "float32", "bfloat16"),
    ("page_size", {"page_size": 16}, 16, 1),
    ("num_layers", {"layers": 5}, 5, 4),
    ("num_kv_heads", {"heads": 2}, 2, 3),
    ("head_dim", {"dim": 16}, 16, 8),
    ("protocol_version", {"spec_overrides": {"protocol_version": 1}}, 1, 2),
]


def token_layer_bytes(dtype: str = "bfloat16") -> int:
    return 2 * HEADS * DIM * torch.empty((), dtype=getattr(torch, dtype)).element_size()


def wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def tid() -> str:
    return uuid.uuid4().hex[:12]


def move(p, d, n, held=0, mode="all", chunk=0, engine="main"):
    """One transfer of `n - held` tokens; returns (sender slots, receiver slots, transfer id)."""
    src = ray.get(p.alloc.remote(n, engine))[held:]
    dst = ray.get(d.alloc.remote(n - held, engine))
    t = tid()
    ticket = ray.get(d.expect.remote(t, dst, held, engine=engine))
    ray.get(p.send.remote(ticket, src, mode, chunk, engine))
    for side in (d, p):
        outcome = ray.get(side.outcome.remote(t))
        assert outcome == "", outcome
    return src, dst, t


def assert_moved(p, d, src, dst, before, engine="main"):
    """The receiver's `dst` rows equal the sender's `src` rows; every other row is unchanged."""
    assert torch.equal(ray.get(d.read.remote(dst, engine)), ray.get(p.read.remote(src, engine)))
    after = ray.get(d.whole_pool.remote(engine))
    keep = torch.ones(after.shape[2], dtype=torch.bool)
    keep[dst] = False
    assert torch.equal(after[:, :, keep], before[:, :, keep])


def free(p, d, src, dst, engine="main"):
    ray.get([p.free.remote(src, engine), d.free.remote(dst, engine)])
