"""Prefill -> decode KV transfer: engines, handshakes and accounting.

A decode replica allocates slots for the part of a request's prompt it does not already hold,
registers them (`KVTransferEngine.expect`) and passes the resulting `KVTicket` to the prefill
replica through the router. The prefill replica computes the prompt and sends exactly those
tokens' K/V, all layers, from its own slots into the ticket's (`KVTransferEngine.send`), layer by
layer while it computes or all at once after. The decode replica's future resolves once every
page is in place; it then inserts the prefix into its radix tree, so a conversation's next turn
moves only the new pages.

A tensor-parallel replica runs one engine per rank over that rank's pool (its own KV heads); a
ticket carries every rank's endpoint. Between replicas of one degree rank r sends all its heads
to rank r; between degrees, each receiving rank gets each of its heads from one sending rank
that holds it, a transfer per (sender rank, receiver rank) pair (workers/executor/tp_kv.py).

Transports (`--kv-transfer auto|gloo|nccl|ray`; auto = nccl for CUDA pools, gloo for CPU):
  gloo / nccl  one 2-rank torch.distributed process group per (sender, receiver) pair, built
               lazily over a TCPStore that the receiver hosts; no global process group. Frames go
               through the store, payloads through the group (dist_transport.py).
  ray          payloads through the Ray object store, frames through the receiver's inbox actor
               (ray_transport.py, ray_inbox.py).
Both gather from the sender's pool (index_select over its slot list) into one contiguous payload
and scatter into the receiver's slots (index_copy_); a handshake (spec.py) refuses a peer with a
different model, dtype, page size, head layout or transport, naming each field.

Why not Mooncake's transfer engine or NIXL: both are built for RDMA (InfiniBand / RoCE verbs,
GPUDirect RDMA into registered GPU memory, multi-NIC striping, topology-aware NIC choice) and
write straight into the peer's registered memory with no staging copy. Both also run here, on
TCP (Mooncake, whose wheel still needs the system's libibverbs) or UCX (NIXL, whose wheel pulls a
CUDA build of torch unless installed without dependencies), at the same order of throughput as
gloo on one CPU host, where they buy nothing: the win needs RDMA NICs. They also bring native
wheels, a metadata service (etcd, HTTP or their own handshake) and pool-wide memory
registration. torch.distributed is already here, speaks NCCL (NVLink, GPUDirect RDMA) on GPU
nodes with the same code, and on CPUs the staging copies hide behind the wire: payloads of at
most 8 MiB let one payload's gather overlap the previous one's send, and 1k tokens of SmolLM2's KV
move in 12-14 ms, 93% of one raw gloo send of the same bytes (load_tests/bench_kv_transfer.py).
An RDMA transport can be added later as one more `KVTransferEngine` (`_listen` / `_open_link`).
"""

from __future__ import annotations

from radixserve.workers.disaggregation.config import KVTransferConfig
from radixserve.workers.disaggregation.engine import KVTransferEngine
from radixserve.workers.disaggregation.errors import (
    HandshakeMismatch,
    KVTransferError,
    PeerLost,
    TransferCancelled,
    TransferRefused,
    TransferTimeout,
)
from radixserve.workers.disaggregation.messages import KVEndpoint, KVTicket
from radixserve.workers.disaggregation.spec import KVSpec, model_fingerprint
from radixserve.workers.disaggregation.transfer import RecvHandle, SendHandle, layer_by_layer
from radixserve.workers.mem_cache.kv_pool import KVPool
from radixserve.workers.protocol import KV_TRANSFER_CHOICES


def resolve_transport(kind: str, pool: KVPool) -> str:
    """`auto` -> nccl for a CUDA pool, gloo otherwise; the rest are taken as given."""
    if kind not in KV_TRANSFER_CHOICES:
        raise ValueError(f"--kv-transfer must be one of {', '.join(KV_TRANSFER_CHOICES)}, got {kind!r}")
    if kind == "auto":
        return "nccl" if pool.device.type == "cuda" else "gloo"
    if kind == "gloo" and pool.device.type == "cuda":
        # Gloo's send/recv read and write host memory: a GPU pool's pointers would go to the socket.
        raise ValueError("--kv-transfer gloo moves CPU tensors; a GPU KV pool moves over nccl or ray")
    return kind


def create_kv_transfer_engine(
    kind: str,
    pool: KVPool,
    replica_id: str,
    served_model_name: str,
    fingerprint: str,
    config: KVTransferConfig | None = None,
    kv_heads: tuple[int, int, int] | None = None,
) -> KVTransferEngine:
    """The engine for `--kv-transfer kind` over `pool`, for one replica (or one rank of it: the
    pool holds the model's KV heads kv_heads = (begin, end, the model's))."""
    transport = resolve_transport(kind, pool)
    spec = KVSpec.for_pool(pool, served_model_name, fingerprint, transport, kv_heads)
    if transport == "ray":
        from radixserve.workers.disaggregation.ray_transport import RayTransferEngine

        return RayTransferEngine(pool, spec, replica_id, config)
    from radixserve.workers.disaggregation.dist_transport import TorchDistTransferEngine

    return TorchDistTransferEngine(pool, spec, replica_id, config)


__all__ = [
    "KV_TRANSFER_CHOICES",
    "HandshakeMismatch",
    "KVEndpoint",
    "KVSpec",
    "KVTicket",
    "KVTransferConfig",
    "KVTransferEngine",
    "KVTransferError",
    "PeerLost",
    "RecvHandle",
    "SendHandle",
    "TransferCancelled",
    "TransferRefused",
    "TransferTimeout",
    "create_kv_transfer_engine",
    "layer_by_layer",
    "model_fingerprint",
    "resolve_transport",
]
