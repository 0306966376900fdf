"""The adapters of one engine: registered names, copies in memory, and the batch slots.

- Registered: the adapters this replica serves by name (`--lora-paths` at start, `register` /
  `unregister` at run time), each checked by loading it once.
- Loaded: adapter weights in host memory, cut to this rank's shard, at most `max_loaded` of them;
  beyond that the least recently used one is dropped (a copy in a batch slot stays usable), and
  read again from its directory when a request asks for it (on the loader thread, never the
  engine's; a waiting request whose adapter was dropped asks again at its next admission try).
- Slots: the `max_per_batch` places of the stacked buffers the forward computes with (layers.py).
  A running sequence holds its adapter's slot; a sequence whose adapter has no slot waits until
  one is free (no running sequence uses it), so a batch never mixes more than `max_per_batch`
  adapters. Slots keep their adapter after use: a returning adapter costs no copy.

A request names its adapter and the adapter's directory (`LoRARef`); a replica that does not know
the name (started after it was loaded elsewhere) loads it from there on first use, without
registering it. An adapter is identified by (name, path): one loaded again from another
directory under the same name is a different adapter, in its own cache namespace.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from radixserve.workers.lora.adapter import LoRAAdapter, LoRAError, load_adapter
from radixserve.workers.lora.layers import LoRABatch, LoRAContext, LoRAProjection
from radixserve.workers.models.linear import Linear

if TYPE_CHECKING:
    from radixserve.workers.engine.request import Req

logger = logging.getLogger("radixserve.engine")

Key = tuple[str, str]  # (name, path)
# Projections an adapter may reach (the model's names, fused).
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class LoRAManager:
    def __init__(
        self,
        model: nn.Module,
        max_per_batch: int,
        max_rank: int,
        max_loaded: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.model, self.dtype, self.max_rank, self.max_loaded = model, dtype, max_rank, max_loaded
        self.ctx = LoRAContext()
        self.projections: dict[str, LoRAProjection] = {}
        for name, module in model.named_modules():
            if isinstance(module, Linear) and name.rsplit(".", 1)[-1] in PROJECTIONS:
                proj = LoRAProjection(module, self.ctx, max_per_batch, max_rank, dtype, device)
                module.lora = proj
                self.projections[name] = proj
        self._lock = threading.Lock()
        self._registered: dict[str, str] = {}  # name -> path
        self._loaded: OrderedDict[Key, LoRAAdapter] = OrderedDict()  # least recently used first
        self._loading: dict[Key, Future] = {}
        self._failed: dict[Key, str] = {}  # loads that failed, until a request asks again
        self._slots: list[Key | None] = [None] * max_per_batch
        self._refs = [0] * max_per_batch
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="lora-load")
        # Rank 0 of a tensor-parallel engine: tell the other ranks to fill a slot as this one
        # did; returns None, or why some rank could not.
        self.on_fill: Callable[[int, Key], str | None] | None = None

    @property
    def nbytes(self) -> int:
        """The slot buffers' memory (fixed at start)."""
        return sum(p.nbytes for p in self.projections.values())

    @property
    def loaded_bytes_cap(self) -> int:
        """The most memory the adapters kept in memory take (max_loaded of the maximum rank)."""
        return self.nbytes // len(self._slots) * self.max_loaded

    # Registry (any thread) -------------------------------------------------------------------
    def register(self, name: str, path: str) -> LoRAAdapter:
        """Load and check an adapter and serve it under `name` (replacing an adapter of that
        name: requests already running keep theirs). Raises LoRAError."""
        adapter = load_adapter(name, path, self.model, self.max_rank, self.dtype)
        with self._lock:
            self._registered[name] = path
            self._keep((name, path), adapter)
        return adapter

    def unregister(self, name: str) -> bool:
        with self._lock:
            path = self._registered.pop(name, None)
            if path is not None and (name, path) not in self._slots:
                self._loaded.pop((name, path), None)
        return path is not None

    def registered(self) -> dict[str, str]:
        with self._lock:
            return dict(self._registered)

    def loaded_bytes(self) -> dict[str, int]:
        """The memory of each adapter kept in memory (its weights, this rank's shard)."""
        with self._lock:
            return {k[0]: a.nbytes for k, a in self._loaded.items()}

    def loaded(self) -> list[str]:
        """Names of the adapters in memory (held in a slot or loaded), most recent last."""
        with self._lock:
            names = [k[0] for k in self._loaded]
            names += [k[0] for k in self._slots if k is not None and k[0] not in names]
        return names

    # Requests (the engine thread) ------------------------------------------------------------
    def prepare(self, req: Req) -> None:
        """Start loading the request's adapter if it is not in memory."""
        key = req.lora
        if key is None:
            return
        with self._lock:
            if key in self._loaded or key in self._slots or key in self._loading:
                return
            self._failed.pop(key, None)
            self._loading[key] = self._loader.submit(self._load, key)

    def waiting_for(self, req: Req) -> str | None:
        """ "loading" while the request's adapter is read; the error when its load failed (the
        request cannot run); None once it is in memory or the request has no adapter."""
        key = req.lora
        if key is None:
            return None
        with self._lock:
            if key in self._slots or key in self._loaded:
                return None
            if key in self._failed:
                return self._failed[key]
            loading = key in self._loading
        if not loading:
            self.prepare(req)  # dropped from memory while the request waited
        return "loading"

    def _load(self, key: Key) -> None:
        try:
            adapter = load_adapter(key[0], key[1], self.model, self.max_rank, self.dtype)
        except Exception as exc:  # a bad or vanished directory fails its requests, not the engine
            logger.warning("LoRA adapter %r from %r could not be loaded: %s", key[0], key[1], exc)
            with self._lock:
                self._loading.pop(key, None)
                self._failed[key] = f"LoRA adapter {key[0]!r} could not be loaded: {exc}"
            return
        with self._lock:
            self._loading.pop(key, None)
            self._keep(key, adapter)

    def _keep(self, key: Key, adapter: LoRAAdapter) -> None:
        """Under the lock: remember `adapter`, dropping the least recently used beyond max_loaded."""
        self._loaded[key] = adapter
        self._loaded.move_to_end(key)
        while len(self._loaded) > self.max_loaded:
            self._loaded.popitem(last=False)

    def place(self, req: Req) -> str | None:
        """Put the request's adapter (in memory: `waiting_for` said so) in a batch slot unless
        it holds one: "wait" while every slot is held by running sequences; an error if the
        other ranks could not take it (`on_fill`); None once it has its slot."""
        key = req.lora
        if key is None or key in self._slots:
            return None
        free = [s for s, r in enumerate(self._refs) if r == 0]
        if not free:
            return "wait"
        # Prefer a slot never used, then the lowest (the gathered form computes slots [0, hi)).
        slot = next((s for s in free if self._slots[s] is None), free[0])
        with self._lock:
            adapter = self._loaded.get(key)
        if adapter is None:
            raise RuntimeError(f"LoRA adapter {key[0]!r} is not in memory: waiting_for was not asked")
        self._slots[slot] = None  # what it held is gone, whatever the other ranks answer
        self._fill(slot, adapter)
        if self.on_fill is not None:
            error = self.on_fill(slot, key)
            if error is not None:
                self._fill(slot, None)
                return f"LoRA adapter {key[0]!r}: {error}"
        self._slots[slot] = key
        return None

    def fill(self, slot: int, key: Key) -> None:
        """A following rank: put adapter `key` in `slot` as rank 0 did (read here if need be).
        Raises LoRAError when this rank cannot read it."""
        with self._lock:
            adapter = self._loaded.get(key)
        if adapter is None:
            adapter = load_adapter(key[0], key[1], self.model, self.max_rank, self.dtype)
            with self._lock:
                self._keep(key, adapter)
        self._fill(slot, adapter)
        self._slots[slot] = key

    def _fill(self, slot: int, adapter: LoRAAdapter | None) -> None:
        for name, proj in self.projections.items():
            proj.set_slot(slot, None if adapter is None else adapter.modules.get(name))

    def acquire(self, req: Req) -> None:
        """The request runs: it holds its adapter's slot (`place` put it there) until `release`."""
        key = req.lora
        if key is None or req.lora_slot is not None:
            return
        slot = self._slots.index(key)
        with self._lock:
            if key in self._loaded:
                self._loaded.move_to_end(key)
        self._refs[slot] += 1
        req.lora_slot = slot

    def release(self, req: Req) -> None:
        if req.lora_slot is not None:
            self._refs[req.lora_slot] -= 1
            req.lora_slot = None

    def held_slots(self) -> int:
        """Slots some running sequence holds (0 when idle: the idle invariant)."""
        return sum(1 for r in self._refs if r)

    # The forward -----------------------------------------------------------------------------
    def batch(self, token_slots: list[int], device: torch.device) -> LoRABatch | None:
        return LoRABatch.of(token_slots, self.dtype, device)

    def stats(self) -> dict[str, Any]:
        return {
            "lora_adapters_registered": len(self.registered()),
            "lora_adapters_in_memory": len(self.loaded()),
            "lora_slots_held": self.held_slots(),
        }

    def close(self) -> None:
        self._loader.shutdown(wait=False, cancel_futures=True)


__all__ = ["LoRAError", "LoRAManager"]
