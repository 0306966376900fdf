"""The torch.distributed transport: one 2-rank process group per (sender, receiver) pair.

No global process group is involved. A receiving replica hosts a TCPStore (the control plane);
a sender connects to it, queues a Hello, reads the HelloReply and, if the specs agree, both sides
build a ProcessGroupGloo (CPU pools) or ProcessGroupNCCL (CUDA pools) over a PrefixStore named
after the connection's nonce: sender rank 0, receiver rank 1. Frames travel as JSON through two
store queues per pair (`tx` to the receiver, `ack` back), payloads through the group with tag =
the frame's sequence number (dist_link.py). A gloo/nccl wait that times out closes the group; the
pair is then torn down on both sides and rebuilt by the next transfer.
"""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from radixserve.workers.disaggregation.config import KVTransferConfig
from radixserve.workers.disaggregation.dist_link import (
    HELLO_QUEUE,
    IDLE_WAIT,
    STOP,
    DistSendLink,
    default_host,
    make_process_group,
    release_group,
)
from radixserve.workers.disaggregation.dist_stream import FrameStream
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
from radixserve.workers.disaggregation.receiver import Connection
from radixserve.workers.disaggregation.spec import KVSpec, check_peer, spec_mismatches
from radixserve.workers.mem_cache.kv_pool import KVPool

logger = logging.getLogger(__name__)


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
        return DistSendLink(
            endpoint,
            on_ack,
            on_broken,
            replica_id=self.replica_id,
            spec=self.spec,
            host=self.host,
            device=self.view.device,
            config=self.config,
        )

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

        self._receiver.connected(Connection(hello.nonce, hello.sender_id, send_back, wake, backlog))
        store.set_timeout(IDLE_WAIT)
        stream = FrameStream(store, tx, pg, self.view, self.config.op_timeout)
        error: KVTransferError = PeerLost(f"connection of prefill replica {hello.sender_id!r} closed")
        try:
            while not self._closed.is_set():
                frame = stream.next()
                if frame.kind == FrameKind.STOP:
                    break
                self._receiver.on_frame(hello.nonce, frame, stream.reader(frame))
        except KVTransferError as exc:
            error = exc
        except Exception as exc:  # a transport error ends the connection
            error = PeerLost(f"pair with prefill replica {hello.sender_id!r} broke: {exc}")
        self._receiver.drop(hello.nonce, error)
        release_group(pg, self.transport)
        # Queues cannot be deleted from a TCPStore: empty this one so the store does not keep it.
        try:
            with push_lock:
                while push.queue_len(tx):
                    push.queue_pop(tx, False)
        except Exception:
            pass
