"""The Ray object store transport: the fallback that works wherever Ray does.

The sender packs each payload, `ray.put`s it and hands the ObjectRef with its frame to the
receiver's inbox actor (ray_inbox.py); the receiving replica takes frames and refs from its inbox
in sequence order, `ray.get`s each payload (zero-copy from the node's object store; Ray moves it
between nodes) and scatters it. Slower than a process group (every payload is copied into the
object store, and between nodes once more), but it needs no port, no rendezvous and no NCCL.
"""

from __future__ import annotations

import logging
import threading
import uuid
import warnings
from typing import Any

import ray
import torch

from radixserve.workers.disaggregation.config import KVTransferConfig
from radixserve.workers.disaggregation.engine import KVTransferEngine
from radixserve.workers.disaggregation.errors import KVTransferError, PeerLost
from radixserve.workers.disaggregation.link import SendLink
from radixserve.workers.disaggregation.messages import Frame, FrameKind, Hello, HelloReply, KVEndpoint
from radixserve.workers.disaggregation.packing import Piece
from radixserve.workers.disaggregation.ray_inbox import KVInbox
from radixserve.workers.disaggregation.receiver import Connection, ProtocolError
from radixserve.workers.disaggregation.spec import KVSpec, check_peer
from radixserve.workers.mem_cache.kv_pool import KVPool

logger = logging.getLogger(__name__)


class RaySendLink(SendLink):
    def __init__(self, engine: RayTransferEngine, endpoint: KVEndpoint, on_ack, on_broken):
        super().__init__(on_ack, on_broken)
        self._engine = engine
        self._endpoint = endpoint
        self._cfg: KVTransferConfig = engine.config
        self._nonce = uuid.uuid4().hex
        self._inbox: Any = None
        self._closing = False
        self._reader: threading.Thread | None = None

    def connect(self) -> None:
        namespace, _, name = self._endpoint.address.partition("/")
        e = self._engine
        try:
            self._inbox = ray.get_actor(name, namespace=namespace)
            reply = HelloReply.from_dict(
                ray.get(
                    self._inbox.hello.remote(Hello(e.replica_id, self._nonce, e.spec).to_dict()),
                    timeout=self._cfg.connect_timeout,
                )
            )
        except (ValueError, ray.exceptions.RayError) as exc:
            raise PeerLost(
                f"cannot reach decode replica {self._endpoint.replica_id!r} at {self._endpoint.address}: {exc}"
            ) from exc
        check_peer(
            e.spec, reply.spec, f"prefill replica {e.replica_id!r}", f"decode replica {reply.receiver_id!r}"
        )
        if reply.error:
            raise KVTransferError(reply.error)
        self._reader = threading.Thread(
            target=self._read_acks, daemon=True, name=f"kv-acks-{self._endpoint.replica_id}"
        )
        self._reader.start()

    def send(self, frame: Frame, payload: torch.Tensor | None) -> None:
        refs = []
        if payload is not None:
            # put() copies into the object store, so the staging buffer is free when it returns.
            refs.append(ray.put(payload.reshape(-1).view(torch.uint8).cpu().numpy()))
        self._inbox.deliver.remote(self._nonce, frame.to_dict(), refs)

    def heartbeat(self) -> None:
        if self._inbox is not None:
            self._inbox.deliver.remote(self._nonce, Frame(FrameKind.HEARTBEAT).to_dict(), [])

    def close(self) -> None:
        self._closing = True
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(self._cfg.heartbeat_interval + self._cfg.op_timeout)

    def _read_acks(self) -> None:
        try:
            while not self._closing:
                frames = ray.get(
                    self._inbox.next_acks.remote(self._nonce, self._cfg.heartbeat_interval),
                    timeout=self._cfg.peer_timeout,
                )
                if frames is None:
                    raise PeerLost("the receiver dropped the connection")
                for d in frames:
                    frame = Frame.from_dict(d)
                    self.touch()
                    if frame.kind == FrameKind.ACK:
                        self.on_ack(frame)
        except Exception as exc:  # the inbox (and so the receiver) is gone or hung
            if not self._closing:
                self.on_broken(exc)


class RayTransferEngine(KVTransferEngine):
    """KV transfer through the Ray object store; the receiving side owns a KVInbox actor."""

    transport = "ray"

    def __init__(self, pool: KVPool, spec: KVSpec, replica_id: str, config: KVTransferConfig | None = None):
        super().__init__(pool, spec, replica_id, config)
        self._inbox: Any = None
        self._reader: threading.Thread | None = None

    def _open_link(self, endpoint: KVEndpoint, on_ack, on_broken) -> SendLink:
        return RaySendLink(self, endpoint, on_ack, on_broken)

    def _listen(self) -> KVEndpoint:
        if not ray.is_initialized():
            raise KVTransferError("the ray KV transport needs Ray to be initialized in this process")
        namespace = ray.get_runtime_context().namespace
        name = f"radixserve-kv-inbox-{self.replica_id}-{uuid.uuid4().hex[:8]}"
        actor = ray.remote(num_cpus=0, max_restarts=0)(KVInbox)
        self._inbox = actor.options(name=name, namespace=namespace).remote(
            self.replica_id, self.spec.to_dict()
        )
        self._reader = threading.Thread(target=self._read, daemon=True, name=f"kv-inbox-{self.replica_id}")
        self._reader.start()
        return KVEndpoint("ray", self.replica_id, f"{namespace}/{name}")

    def _close_transport(self) -> None:
        if self._reader is not None:
            self._reader.join(self.config.heartbeat_interval + self.config.op_timeout)
        if self._inbox is not None:
            ray.kill(self._inbox)
            self._inbox = None

    def _read(self) -> None:
        while not self._closed.is_set():
            try:
                items = ray.get(self._inbox.take.remote(self.config.heartbeat_interval))
            except ray.exceptions.RayError as exc:
                if not self._closed.is_set():
                    logger.error("KV inbox of %s is gone: %s", self.replica_id, exc)
                return
            for item in items:
                if item[0] == "hello":
                    self._on_hello(item[1], item[2], item[3])
                else:
                    self._on_frame(item[1], Frame.from_dict(item[2]), item[3])

    def _on_hello(self, nonce: str, hello: dict[str, Any], error: str) -> None:
        h = Hello.from_dict(hello)
        if error:
            logger.warning("%s", error)
            self.refusals.append(error)
            self.stats.count(h.sender_id, handshakes_refused=1)
            return
        inbox = self._inbox
        self._receiver.connected(
            Connection(
                nonce,
                h.sender_id,
                lambda f: inbox.ack.remote(nonce, f.to_dict()),
                lambda _error: inbox.drop.remote(nonce),
            )
        )

    def _on_frame(self, nonce: str, frame: Frame, refs: list) -> None:
        def read(piece: Piece) -> torch.Tensor:
            data = ray.get(refs[0], timeout=self.config.op_timeout)
            with warnings.catch_warnings():  # the object store's buffer is read-only; it is only read
                warnings.simplefilter("ignore", UserWarning)
                flat = torch.from_numpy(data)
            return flat.view(self.view.dtype).view(self.view.payload_shape(piece)).to(self.view.device)

        try:
            self._receiver.on_frame(nonce, frame, read)
        except (ProtocolError, ray.exceptions.RayError, IndexError) as exc:
            self._receiver.drop(nonce, PeerLost(f"connection {nonce[:8]} broke: {exc}"))
