"""`KVTransferEngine`: one replica's end of the prefill -> decode KV fabric.

The same object sends (prefill side) and receives (decode side); a replica usually does one of
the two. Transports (torch.distributed, the Ray object store) subclass it and provide only the
wire: how a receiver listens (`_listen`) and how a sender reaches it (`_open_link`). The transfer
bookkeeping, ordering, deadlines, liveness and accounting are shared and live in KVSender and
KVReceiver.

Threads: one per sending pair (it connects, gathers and sends), the transport's readers on the
receiving side, and one ticker per engine (heartbeats, liveness, deadlines). No method blocks on
the network except `close()`; results come back as futures.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from typing import Any

from radixserve.workers.disaggregation.config import KVTransferConfig
from radixserve.workers.disaggregation.errors import KVTransferError
from radixserve.workers.disaggregation.link import SendLink
from radixserve.workers.disaggregation.messages import Frame, KVEndpoint, KVTicket
from radixserve.workers.disaggregation.packing import PoolView
from radixserve.workers.disaggregation.receiver import KVReceiver
from radixserve.workers.disaggregation.sender import KVSender
from radixserve.workers.disaggregation.spec import KVSpec
from radixserve.workers.disaggregation.stats import TransferStats
from radixserve.workers.disaggregation.transfer import RecvHandle, SendHandle
from radixserve.workers.mem_cache.kv_pool import KVPool

logger = logging.getLogger(__name__)

# The spec fields a pool determines; the rest (model identity, transport) are the caller's.
POOL_FIELDS = ("dtype", "page_size", "num_layers", "head_dim")


class KVTransferEngine(ABC):
    """Moves requests' KV pages between this replica's pool and other replicas' pools.

    Decode side: `expect(transfer_id, dst_slots, held_tokens)` before the prefill starts; hand
    `handle.ticket` to the prefill replica (through the router); await `handle.future`, then
    insert the prefix into the radix tree. `handle.cancel()` on abort; the slots may be freed once
    it returns.

    Prefill side: `send(ticket, src_slots)`; then `send_layers(l, l + 1)` as each layer's KV is
    written (or `send_all()` after the forward), `finish()`, and keep the source slots locked
    until the future resolves.
    """

    transport: str = ""

    def __init__(self, pool: KVPool, spec: KVSpec, replica_id: str, config: KVTransferConfig | None = None):
        if spec.transport != self.transport:
            raise ValueError(f"a {self.transport} engine got a spec for transport {spec.transport!r}")
        kv_heads = (*spec.kv_heads, spec.num_kv_heads)
        pool_spec = KVSpec.for_pool(pool, spec.served_model_name, spec.fingerprint, spec.transport, kv_heads)
        for name in POOL_FIELDS:
            if getattr(pool_spec, name) != getattr(spec, name):
                raise ValueError(
                    f"KVSpec.{name} is {getattr(spec, name)!r} but the pool's is {getattr(pool_spec, name)!r}"
                )
        self.pool = pool
        self.spec = spec
        self.replica_id = replica_id
        self.config = config or KVTransferConfig()
        self.view = PoolView(pool, spec.kv_heads)
        self.stats = TransferStats()
        self._sender = KVSender(self.view, self.stats, self.config, self._open_link)
        self._receiver = KVReceiver(self.view, self.stats, self.config)
        self._endpoint: KVEndpoint | None = None
        # The latest handshakes this replica refused, for operators (a misconfigured pool shows
        # up here and in the log, on both sides).
        self.refusals: deque[str] = deque(maxlen=32)
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name=f"kv-ticker-{replica_id}", daemon=True)
        self._ticker.start()

    # -- receiving side ------------------------------------------------------------------------

    def endpoint(self) -> KVEndpoint:
        """Where senders reach this replica; starts listening on the first call."""
        with self._lock:
            if self._closed.is_set():
                raise KVTransferError("the KV transfer engine is closed")
            if self._endpoint is None:
                self._endpoint = self._listen()
            return self._endpoint

    def expect(
        self,
        transfer_id: str,
        dst_slots,
        held_tokens: int = 0,
        timeout: float | None = None,
        heads: tuple[int, int] | None = None,
    ) -> RecvHandle:
        """Register a transfer into `dst_slots` (allocated already, in token order) of the tokens
        after the `held_tokens` this replica already holds: the model's KV heads `heads` (default:
        every head of this pool). The handle's `ticket` is what the sender needs; its future
        resolves when every page is in the slots, or fails (deadline: `timeout`, default
        config.transfer_timeout)."""
        return self._receiver.expect(transfer_id, self.endpoint(), dst_slots, held_tokens, timeout, heads)

    # -- sending side --------------------------------------------------------------------------

    def send(
        self, ticket: KVTicket, src_slots, timeout: float | None = None, heads: tuple[int, int] | None = None
    ) -> SendHandle:
        """Start sending `src_slots` (this replica's slots for the ticket's tokens, in order): the
        model's KV heads `heads` (default: every head of this pool)."""
        if ticket.endpoint.transport != self.transport:
            raise KVTransferError(
                f"transfer {ticket.transfer_id!r}: the receiver uses {ticket.endpoint.transport!r}, this replica {self.transport!r}"
            )
        return self._sender.send(ticket, src_slots, timeout, heads)

    # -- both ----------------------------------------------------------------------------------

    def stats_snapshot(self) -> dict[str, Any]:
        """Byte and transfer counters per peer and in total, plus the transfers open right now."""
        out = self.stats.snapshot()
        out["open"] = self.open_transfers()
        return out

    def open_transfers(self) -> dict[str, int]:
        """Transfers not yet settled: {"sending": n, "receiving": m}; both 0 when idle."""
        return {"sending": self._sender.open_count(), "receiving": self._receiver.open_count()}

    def close(self) -> None:
        """Fail every open transfer, tear every pair down and stop every thread this engine runs."""
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
        self._sender.close()
        self._receiver.close()
        self._close_transport()
        self._ticker.join(self.config.op_timeout)

    def _tick(self) -> None:
        while not self._closed.wait(self.config.heartbeat_interval):
            now = time.monotonic()
            try:
                self._sender.tick(now)
                self._receiver.tick(now)
            except Exception:  # the ticker must outlive any one failure it reports
                logger.exception("KV transfer ticker of %s", self.replica_id)

    # -- the transport -------------------------------------------------------------------------

    @abstractmethod
    def _listen(self) -> KVEndpoint:
        """Start accepting connections; report each through `self._receiver`."""

    @abstractmethod
    def _open_link(
        self,
        endpoint: KVEndpoint,
        on_ack: Callable[[Frame], None],
        on_broken: Callable[[BaseException], None],
    ) -> SendLink:
        """A not yet connected link to `endpoint` (the pair's thread connects it)."""

    @abstractmethod
    def _close_transport(self) -> None:
        """Stop listening and join the transport's threads."""
