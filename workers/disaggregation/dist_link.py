"""The torch.distributed pair, sender side: the control plane through the receiver's TCPStore,
the data plane through a 2-rank process group built for this pair alone.

Store keys of a pair (all on the receiver's store): the `kv/hello` queue (every sender's Hello),
`kv/<nonce>/reply` (the HelloReply), the `kv/<nonce>/tx` queue (frames to the receiver), the
`kv/<nonce>/ack` queue (frames back) and `kv/<nonce>/pg/*` (the group's own rendezvous). A side
wakes its own blocked queue reader with a STOP frame, so nothing polls.
"""

from __future__ import annotations

import datetime
import socket
import threading
import uuid
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from radixserve.workers.disaggregation.config import KVTransferConfig
from radixserve.workers.disaggregation.errors import KVTransferError, PeerLost
from radixserve.workers.disaggregation.link import SendLink
from radixserve.workers.disaggregation.messages import (
    Frame,
    FrameKind,
    Hello,
    HelloReply,
    KVEndpoint,
    decode,
    encode,
)
from radixserve.workers.disaggregation.spec import KVSpec, check_peer
from radixserve.workers.distributed.group import nccl_errors_raise

HELLO_QUEUE = "kv/hello"
# Blocking store reads are woken by a frame, a heartbeat or STOP; the timeout is a backstop only.
IDLE_WAIT = datetime.timedelta(hours=24)
TAG_SPACE = 1 << 30
STOP = encode(Frame(FrameKind.STOP))
# How long a receiver's port may take to accept before the pair gives up (a refused connect fails
# at once; the store connection that follows has connect_timeout).
PROBE_TIMEOUT_S = 5.0


def default_host() -> str:
    """This node's address as peers see it: Ray's node address when Ray is up, else loopback."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # Ray is an optional source of the address
        pass
    return "127.0.0.1"


def make_process_group(backend: str, store: dist.Store, rank: int, timeout: float, host: str):
    """A 2-rank process group of `backend` over `store`, outside the global default group."""
    td = datetime.timedelta(seconds=timeout)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._timeout = td
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        return dist.ProcessGroupGloo(store, rank, 2, opts)
    if backend == "nccl":
        if not dist.is_nccl_available():
            raise KVTransferError("the nccl KV transport needs a CUDA build of torch with NCCL")
        nccl_errors_raise()
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = td
        return dist.ProcessGroupNCCL(store, rank, 2, opts)
    raise ValueError(f"unknown process group backend {backend!r}")


def wire(payload: torch.Tensor) -> torch.Tensor:
    """A payload as flat bytes: a group moves bytes, whatever the cache dtype."""
    return payload.reshape(-1).view(torch.uint8)


def timed_wait(work, seconds: float) -> None:
    work.wait(datetime.timedelta(seconds=seconds))


def release_group(pg: Any, backend: str) -> None:
    """Drop a pair's group. An NCCL communicator with an op still queued would block its own
    destruction (and trip the watchdog): abort it first. Gloo closes its sockets on destruction."""
    if pg is not None and backend == "nccl":
        try:
            pg.abort()
        except Exception:
            pass


class DistSendLink(SendLink):
    """The sender's end: store client(s) to the receiver, and the pair's process group (rank 0)."""

    def __init__(
        self,
        endpoint: KVEndpoint,
        on_ack,
        on_broken,
        *,
        replica_id: str,
        spec: KVSpec,
        host: str,
        device: torch.device,
        config: KVTransferConfig,
    ):
        super().__init__(on_ack, on_broken)
        self._endpoint = endpoint
        self._replica_id = replica_id
        self._spec = spec
        self._host = host
        self._device = device
        self._cfg = config
        self._nonce = uuid.uuid4().hex
        self._push_lock = threading.Lock()
        self._push_store: dist.TCPStore | None = None
        self._pg: Any = None
        self._closing = False
        self._reader: threading.Thread | None = None

    def connect(self) -> None:
        host, _, port = self._endpoint.address.rpartition(":")
        td = datetime.timedelta(seconds=self._cfg.connect_timeout)
        try:
            # A receiver that is gone refuses the connection: say so now. (A TCPStore client
            # retries a refused connect until its whole timeout, and nothing can interrupt it:
            # the transfer would fail only at its deadline, and closing this replica would wait.)
            probe_s = min(self._cfg.connect_timeout, PROBE_TIMEOUT_S)
            socket.create_connection((host, int(port)), timeout=probe_s).close()
            store = dist.TCPStore(host, int(port), is_master=False, timeout=td, wait_for_workers=False)
        except Exception as exc:
            raise PeerLost(
                f"cannot reach decode replica {self._endpoint.replica_id!r} at {self._endpoint.address}: {exc}"
            ) from exc
        self._push_store = store
        store.queue_push(HELLO_QUEUE, encode(Hello(self._replica_id, self._nonce, self._spec)))
        reply: HelloReply = decode(store.get(f"kv/{self._nonce}/reply"))
        store.delete_key(f"kv/{self._nonce}/reply")
        check_peer(
            self._spec,
            reply.spec,
            f"prefill replica {self._replica_id!r}",
            f"decode replica {reply.receiver_id!r}",
        )
        if reply.error:
            raise KVTransferError(reply.error)
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)
        pg_store = dist.PrefixStore(f"kv/{self._nonce}/pg", store)
        self._pg = make_process_group(self._spec.transport, pg_store, 0, self._cfg.op_timeout, self._host)
        reader_store = store.clone()  # type: ignore[attr-defined]
        reader_store.set_timeout(IDLE_WAIT)
        self._reader = threading.Thread(
            target=self._read_acks,
            args=(reader_store,),
            daemon=True,
            name=f"kv-acks-{self._endpoint.replica_id}",
        )
        self._reader.start()

    def send(self, frame: Frame, payload: torch.Tensor | None) -> Callable[[], None] | None:
        self._push(f"kv/{self._nonce}/tx", encode(frame))
        if payload is None:
            return None
        work = self._pg.send([wire(payload)], 1, frame.seq % TAG_SPACE)
        return lambda: timed_wait(work, self._cfg.op_timeout)

    def heartbeat(self) -> None:
        self._push(f"kv/{self._nonce}/tx", encode(Frame(FrameKind.HEARTBEAT)))

    def close(self) -> None:
        self._closing = True
        try:
            self._push(f"kv/{self._nonce}/ack", STOP)
        except Exception:  # the store is gone: the reader has failed out already
            pass
        if self._reader is not None:
            self._reader.join(self._cfg.op_timeout)
        release_group(self._pg, self._spec.transport)
        self._pg = None
        self._push_store = None

    def _push(self, key: str, data: bytes) -> None:
        with self._push_lock:
            if self._push_store is None:
                raise PeerLost("the pair is not connected")
            self._push_store.queue_push(key, data)

    def _read_acks(self, store: dist.TCPStore) -> None:
        try:
            while not self._closing:
                frame: Frame = decode(store.queue_pop(f"kv/{self._nonce}/ack"))
                if frame.kind == FrameKind.STOP:
                    if frame.error and not self._closing:  # the receiver's goodbye, not our own STOP
                        self.on_broken(PeerLost(frame.error))
                    return
                self.touch()
                if frame.kind == FrameKind.ACK:
                    self.on_ack(frame)
        except Exception as exc:  # a dead store is a dead receiver
            if not self._closing:
                self.on_broken(exc)
