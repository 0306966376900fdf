"""The torch.distributed transport: one 2-rank process group per (sender, receiver) pair.

No global process group is involved. A receiving replica hosts a TCPStore (the control plane);
a sender connects to it, queues a Hello, reads the HelloReply and, if the specs agree, both sides
build a ProcessGroupGloo (CPU pools) or ProcessGroupNCCL (CUDA pools) over a PrefixStore named
after the connection's nonce: sender rank 0, receiver rank 1. Frames travel as JSON through two
store queues per pair (`tx` to the receiver, `ack` back), payloads through the group with tag =
the frame's sequence number. Each side wakes its own blocked queue reader with a STOP frame, so
nothing polls; a gloo/nccl wait that times out closes the group, and the pair is rebuilt by the
next transfer.
"""

from __future__ import annotations

import datetime
import logging
import threading
import uuid
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from radixserve.workers.disaggregation.config import KVTransferConfig
from radixserve.workers.disaggregation.engine import KVTransferEngine
from radixserve.workers.disaggregation.errors import HandshakeMismatch, KVTransferError, PeerLost
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
from radixserve.workers.disaggregation.packing import Piece, StagingBuffer
from radixserve.workers.disaggregation.receiver import Connection
from radixserve.workers.disaggregation.spec import KVSpec, check_peer, spec_mismatches
from radixserve.workers.mem_cache.kv_pool import KVPool

logger = logging.getLogger(__name__)

HELLO_QUEUE = "kv/hello"
# Blocking store reads are woken by a frame, a heartbeat or STOP; the timeout is a backstop only.
IDLE_WAIT = datetime.timedelta(hours=24)
TAG_SPACE = 1 << 30
STOP = encode(Frame(FrameKind.STOP))


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
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = td
        return dist.ProcessGroupNCCL(store, rank, 2, opts)
    raise ValueError(f"unknown process group backend {backend!r}")


def _wire(payload: torch.Tensor) -> torch.Tensor:
    """A payload as the flat bytes a process group moves (gloo has no bfloat16 send path of its own)."""
    return payload.reshape(-1).view(torch.uint8)


def _timed_wait(work, seconds: float) -> None:
    work.wait(datetime.timedelta(seconds=seconds))


class DistSendLink(SendLink):
    """The sender's end: store client(s) to the receiver, and the pair's process group (rank 0)."""

    def __init__(self, engine: TorchDistTransferEngine, endpoint: KVEndpoint, on_ack, on_broken):
        super().__init__(on_ack, on_broken)
        self._engine = engine
        self._endpoint = endpoint
        self._cfg: KVTransferConfig = engine.config
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
            store = dist.TCPStore(host, int(port), is_master=False, timeout=td, wait_for_workers=False)
        except Exception as exc:
            raise PeerLost(
                f"cannot reach decode replica {self._endpoint.replica_id!r} at {self._endpoint.address}: {exc}"
            ) from exc
        self._push_store = store
        e = self._engine
        store.queue_push(HELLO_QUEUE, encode(Hello(e.replica_id, self._nonce, e.spec)))
        reply: HelloReply = decode(store.get(f"kv/{self._nonce}/reply"))
        store.delete_key(f"kv/{self._nonce}/reply")
        check_peer(
            e.spec, reply.spec, f"prefill replica {e.replica_id!r}", f"decode replica {reply.receiver_id!r}"
        )
        if reply.error:
            raise KVTransferError(reply.error)
        if e.view.device.type == "cuda":
            torch.cuda.set_device(e.view.device)
        pg_store = dist.PrefixStore(f"kv/{self._nonce}/pg", store)
        self._pg = make_process_group(e.spec.transport, pg_store, 0, self._cfg.op_timeout, e.host)
        reader_store = store.clone()  # type: ignore[attr-defined]
        reader_store.set_timeout(IDLE_WAIT)
        self._reader = threading.Thread(
            target=self._read_acks,
            args=(reader_store,),
            daemon=True,
            name=f"kv-acks-{self._endpoint.replica_id}",
        )
        self._reader.start()

    def send(self, frame: Frame, payload: torch.Tensor | None) -> None:
        self._push(f"kv/{self._nonce}/tx", encode(frame))
        if payload is not None:
            _timed_wait(self._pg.send([_wire(payload)], 1, frame.seq % TAG_SPACE), self._cfg.op_timeout)

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


class TorchDistTransferEngine(KVTransferEngine):
    """KV transfer over per-pair torch.distributed process groups (`gloo` or `nccl`)."""

    def __init__(self, pool: KVPool, spec: KVSpec, replica_id: str, config: KVTransferConfig | None = None):
        if spec.transport not in ("gloo", "nccl"):
            raise ValueError(f"TorchDistTransferEngine moves KV over gloo or nccl, not {spec.transport!r}")
        self.transport = spec.transport
        self.host = (config.host if config else None) or default_host()
        self._store: dist.TCPStore | None = None
        self._threads: list[threading.Thread] = []
        super().__init__(pool, spec, replica_id, config)

    def _open_link(self, endpoint: KVEndpoint, on_ack, on_broken) -> SendLink:
        return DistSendLink(self, endpoint, on_ack, on_broken)

    def _listen(self) -> KVEndpoint:
        td = datetime.timedelta(seconds=self.config.connect_timeout)
        self._store = dist.TCPStore(
            self.host, self.config.port, is_master=True, wait_for_workers=False, timeout=td
        )
        hello_store = self._store.clone()  # type: ignore[attr-defined]
        hello_store.set_timeout(IDLE_WAIT)
        self._spawn(self._accept, hello_store, name=f"kv-accept-{self.replica_id}")
        return KVEndpoint(self.transport, self.replica_id, f"{self.host}:{self._store.port}")

    def _close_transport(self) -> None:
        if self._store is not None:
            try:
                self._store.queue_push(HELLO_QUEUE, STOP)
            except Exception:
                pass
        for t in list(self._threads):
            t.join(self.config.op_timeout)
        self._store = None

    def _spawn(self, target: Callable, *args, name: str) -> None:
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._threads = [x for x in self._threads if x.is_alive()] + [t]
        t.start()

    def _accept(self, store: dist.TCPStore) -> None:
        while not self._closed.is_set():
            try:
                msg = decode(store.queue_pop(HELLO_QUEUE))
            except Exception as exc:  # the backstop timeout, or the store going away
                if self._closed.is_set():
                    return
                logger.warning("KV acceptor of %s: %s", self.replica_id, exc)
                continue
            if isinstance(msg, Hello):
                self._spawn(self._serve, msg, name=f"kv-recv-{msg.sender_id}")

    def _serve(self, hello: Hello) -> None:
        """One sender's connection, from the handshake to its end, on its own thread."""
        assert self._store is not None
        store = self._store.clone()  # type: ignore[attr-defined]
        fields = spec_mismatches(self.spec, hello.spec)
        error = ""
        if fields:
            try:
                check_peer(
                    self.spec,
                    hello.spec,
                    f"decode replica {self.replica_id!r}",
                    f"prefill replica {hello.sender_id!r}",
                )
            except HandshakeMismatch as exc:
                error = str(exc)
                logger.warning("%s", exc)
                self.refusals.append(error)
            self.stats.count(hello.sender_id, handshakes_refused=1)
        reply = HelloReply(self.replica_id, self.spec, error, {k: list(v) for k, v in fields.items()})
        store.set(f"kv/{hello.nonce}/reply", encode(reply))
        if error:
            return
        try:
            if self.view.device.type == "cuda":
                torch.cuda.set_device(self.view.device)
            pg_store = dist.PrefixStore(f"kv/{hello.nonce}/pg", store)
            pg = make_process_group(self.transport, pg_store, 1, self.config.op_timeout, self.host)
        except Exception as exc:  # the sender went away during setup
            logger.warning("KV pair setup with %s failed: %s", hello.sender_id, exc)
            return
        self._run_connection(hello, store, pg)

    def _run_connection(self, hello: Hello, store: dist.TCPStore, pg) -> None:
        push = store.clone()  # type: ignore[attr-defined]
        push_lock = threading.Lock()
        tx, ack = f"kv/{hello.nonce}/tx", f"kv/{hello.nonce}/ack"

        def send_back(frame: Frame) -> None:
            with push_lock:
                push.queue_push(ack, encode(frame))

        def wake(error: KVTransferError) -> None:
            bye = Frame(FrameKind.STOP, error=f"decode replica {self.replica_id!r} dropped the pair: {error}")
            with push_lock:
                push.queue_push(tx, STOP)
                push.queue_push(ack, encode(bye))

        def backlog() -> int:
            with push_lock:
                return push.queue_len(tx)

        staging = StagingBuffer(self.view)

        def read_payload(seq: int) -> Callable[[Piece], torch.Tensor]:
            def read(piece: Piece) -> torch.Tensor:
                buf = staging.payload(piece)
                _timed_wait(pg.recv([_wire(buf)], 0, seq % TAG_SPACE), self.config.op_timeout)
                return buf

            return read

        self._receiver.connected(Connection(hello.nonce, hello.sender_id, send_back, wake, backlog))
        store.set_timeout(IDLE_WAIT)
        error: KVTransferError = PeerLost(f"connection of prefill replica {hello.sender_id!r} closed")
        try:
            while not self._closed.is_set():
                frame: Frame = decode(store.queue_pop(tx))
                if frame.kind == FrameKind.STOP:
                    break
                self._receiver.on_frame(hello.nonce, frame, read_payload(frame.seq))
        except KVTransferError as exc:
            error = exc
        except Exception as exc:  # a transport error ends the connection
            error = PeerLost(f"pair with prefill replica {hello.sender_id!r} broke: {exc}")
        self._receiver.drop(hello.nonce, error)
