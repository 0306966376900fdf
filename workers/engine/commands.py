"""Commands from other threads to the engine thread, queued in the engine's inbox.

The engine thread runs them between steps, when no forward is in flight (`EngineCore.handle`).
A command that answers carries a Future the caller waits on.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from radixserve.workers.engine.request import Req


@dataclass(frozen=True)
class AddRequest:
    """A validated request: its n sequences, built by `EngineCore.make_reqs`."""

    reqs: list[Req]
    stream: bool  # chunks as they come, rather than one chunk per sequence at the end


@dataclass(frozen=True)
class ReserveRequest:
    """PD, decode side: reserve KV slots for a request's sequences and start decoding them once
    their KV arrives. `done` gets the tickets (one per sequence), or the refusal. Without room
    now, the reservation waits up to `wait_s` for some (0: refused at once)."""

    reqs: list[Req]
    stream: bool
    done: Future
    wait_s: float = 0.0


@dataclass(frozen=True)
class RenewReservations:
    """PD, decode side: the prefill of these requests is still on its way (queued or computing
    on a prefill replica): their reservations' leases start again."""

    rids: tuple[str, ...]


@dataclass(frozen=True)
class AbortRequest:
    rid: str


@dataclass(frozen=True)
class FlushCache:
    done: Future  # True once flushed; False (refused) while requests are in flight


@dataclass(frozen=True)
class CacheSummary:
    max_tokens: int
    done: Future  # the cached prefixes: token lists, most recently used first
    lower: bool = False  # those that end in a lower cache tier instead of the device's


@dataclass(frozen=True)
class RankTransfersOpen:
    done: Future  # the KV transfers open on the tensor-parallel followers (0 at tp_size 1)


@dataclass(frozen=True)
class Stop:
    """Leave the loop; requests still in flight end with an EngineError."""


Command = (
    AddRequest
    | ReserveRequest
    | RenewReservations
    | AbortRequest
    | FlushCache
    | CacheSummary
    | RankTransfersOpen
    | Stop
)
