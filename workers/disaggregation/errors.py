"""Errors a KV transfer ends with. Every one is a `KVTransferError`, so a replica that only cares
whether the pages arrived catches one type; the subclasses say what to do next (retry on another
pair, recompute, or give up on a misconfigured peer)."""

from __future__ import annotations


class KVTransferError(RuntimeError):
    """A transfer (or a pair) failed; the message names the transfer and the peer."""


class HandshakeMismatch(KVTransferError):
    """Two replicas disagree on a field of `KVSpec`; they can never exchange KV.

    `fields` maps each differing field to (this side's value, the peer's value).
    """

    def __init__(self, message: str, fields: dict[str, tuple[object, object]]):
        super().__init__(message)
        self.fields = fields


class PeerLost(KVTransferError):
    """The pair broke (peer died, hung past a timeout, or reconnected); it is torn down and the
    next transfer to that peer builds a new one."""


class TransferTimeout(KVTransferError):
    """The transfer did not complete within its deadline; the pair itself may still be healthy."""


class TransferCancelled(KVTransferError):
    """One side cancelled the transfer (an aborted request, or an engine closing)."""


class TransferRefused(KVTransferError):
    """The receiver refused the transfer: it was not expecting it, or the slot lists disagree."""


def about(error: KVTransferError, transfer_id: str) -> KVTransferError:
    """`error` (a pair's failure) as the failure of one of its transfers: same type and fields,
    the message prefixed with the transfer id."""
    cls = type(error)
    out = cls.__new__(cls)  # not cls(...): subclasses take extra constructor arguments
    out.__dict__.update(error.__dict__)
    out.args = (f"transfer {transfer_id!r}: {error}",)
    return out
