"""One replica's engine: a loop on its own thread that batches requests step by step.

Requests join and leave the running batch at step boundaries. Outputs flow back to asyncio
consumers through per-request queues, handed over with one `call_soon_threadsafe` per event loop
per step. Commands from the inbox run between steps, when no forward is in flight (in overlap mode
the forward runs on a second thread; see EngineCore.step).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any

from radixserve.workers.distributed.launch import RankLauncher
from radixserve.workers.engine.commands import (
    AbortRequest,
    AddRequest,
    CacheSummary,
    Command,
    FlushCache,
    RankTransfersOpen,
    RenewReservations,
    ReserveRequest,
    Stop,
)
from radixserve.workers.engine.config import EngineConfig
from radixserve.workers.engine.engine_core import EngineCore
from radixserve.workers.executor.cpu_runtime import on_short_lived_thread
from radixserve.workers.protocol import (
    EngineError,
    EngineLoad,
    GenerateRequest,
    InvalidRequest,
    LoRARef,
    OutputChunk,
    QueueFull,
    ReplicaStats,
    SamplingParams,
    add_to_native_result,
    is_attempt_of,
    native_result,
)

logger = logging.getLogger("radixserve.engine")

# A command to the engine thread is answered between steps: within this, or it fails.
ASK_TIMEOUT_S = 60.0
ASK_POLL_S = 0.25  # how often a caller waiting for an answer checks that the loop still runs


class RequestStream:
    """Async iterator over one request's OutputChunks (all n sequences interleaved).

    Raises InvalidRequest if the request is refused after submission (its grammar does not
    compile), EngineError if the engine fails it; either ends the stream.
    """

    def __init__(self, rid: str, n: int, loop: asyncio.AbstractEventLoop):
        self.rid = rid
        self.queue: asyncio.Queue = asyncio.Queue()
        self.loop = loop
        self.n = n
        self.remaining = n  # consumer side
        self.finals_sent = 0  # engine side

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> OutputChunk:
        if self.remaining <= 0:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.remaining = 0
            raise item
        if item.finished:
            self.remaining -= 1
        return item


class Engine:
    """The public offline API (SGLang's shape): `Engine(model_path=None, **server_args)`."""

    def __init__(
        self, model_path: str | None = None, *, rank_launcher: RankLauncher | None = None, **kwargs: Any
    ):
        """`rank_launcher`: how ranks 1..tp_size-1 start (default: local processes; a replica
        passes Ray actors in its placement group)."""
        self.config = EngineConfig.from_kwargs(model_path, **kwargs)
        self.core = on_short_lived_thread(EngineCore, self.config, rank_launcher)
        self.tokenizer = self.core.tokenizer
        self.model_config = self.core.model_config
        self.served_model_name = self.core.served_model_name
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._open_sequences = 0  # of the streams: sequences whose final chunk has not been sent
        self._lock = threading.Lock()
        self._stopped = False
        self._failure: str | None = None  # why the engine stopped serving on its own (a rank died)
        self._closed = False  # the loop has ended: no stream registers, no command is answered
        self._thread = threading.Thread(target=self._loop, name="radixserve-engine", daemon=True)
        self._thread.start()

    # Submission ------------------------------------------------------------------------------
    def submit(self, request: GenerateRequest) -> RequestStream:
        """Queue a tokenized request; call from a running event loop and consume there.

        Raises InvalidRequest (a bad request) or QueueFull (`max_queued_requests` sequences are
        waiting already) before anything is queued."""
        if self._stopped:
            raise RuntimeError("engine is shut down")
        loop = asyncio.get_running_loop()
        reqs = self.core.make_reqs(request)  # validates; raises InvalidRequest
        stream = self._register(request, reqs, loop)
        self._inbox.put(AddRequest(reqs, request.stream))
        return stream

    def reserve(self, request: GenerateRequest, wait_s: float = 0.0) -> tuple[RequestStream, Future]:
        """PD, decode role: reserve KV slots for the request's sequences; call from a running
        event loop. The future resolves with one KV ticket (a dict) per sequence, for the prefill
        replica, or fails with QueueFull when the slots are not there within `wait_s` (0: now;
        the stream then ends with nothing). Once a sequence's KV and first token arrived, its
        chunks come on the stream, from the second token on. The reservation's lease runs out
        `kv_transfer_timeout_s` after it was made, unless `renew` restarts it (kv_handoff.py)."""
        if self._stopped:
            raise RuntimeError("engine is shut down")
        loop = asyncio.get_running_loop()
        reqs = self.core.make_reqs(request)
        stream = self._register(request, reqs, loop)
        done: Future = Future()

        def refused(f: Future) -> None:
            if f.cancelled() or f.exception() is not None:
                self._unregister(request.rid)

        done.add_done_callback(refused)
        self._put(ReserveRequest(reqs, request.stream, done, max(0.0, float(wait_s))))
        return stream, done

    def renew(self, rids: list[str]) -> int:
        """PD, decode role: the prefill of these requests is still on its way; the leases of
        their reservations here start again. Ids this engine does not serve are ignored; returns
        how many it does."""
        with self._lock:
            mine = tuple(rid for rid in rids if rid in self._streams)
        if mine:
            self._put(RenewReservations(mine))
        return len(mine)

    def _register(
        self, request: GenerateRequest, reqs: list, loop: asyncio.AbstractEventLoop
    ) -> RequestStream:
        limit = self.config.max_queued_requests
        with self._lock:
            if (failure := self._stopped_by()) is not None:
                raise EngineError(f"the engine has stopped: {failure}")
            if self._closed:  # shut down: the loop answers no stream any more
                raise EngineError(self._ended_message())
            if request.rid in self._streams:
                raise InvalidRequest(f"request id {request.rid!r} is already in use", "rid")
            if limit is not None:
                _check_queue_room(len(reqs), self._queued_locked(), limit)
            stream = RequestStream(request.rid, len(reqs), loop)
            self._streams[request.rid] = stream
            self._open_sequences += len(reqs)
        return stream

    def _unregister(self, rid: str) -> None:
        """A request the engine thread refused before taking it in."""
        with self._lock:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                self._open_sequences -= stream.n - stream.finals_sent

    def num_queued(self) -> int:
        """Sequences submitted and not yet running (in the inbox, the grammar queue or the
        scheduler's waiting queue): what `max_queued_requests` limits."""
        with self._lock:
            return self._queued_locked()

    def _queued_locked(self) -> int:
        # Running sequences whose final chunk went out are released at the next step boundary;
        # until then they count as running, hence the clamp.
        return max(self._open_sequences - self.core.num_running(), 0)

    def load(self) -> EngineLoad:
        """The engine's load signals, cheap and safe from any thread (an event loop included): the
        engine thread publishes them at every step boundary, and the queued count is read under
        the submission lock, so it includes requests the scheduler has not seen yet (in the inbox,
        or waiting for a grammar compile), whose tokens count once they reach its queue."""
        return dataclasses.replace(self.core.load, queued_sequences=self.num_queued())

    def abort(self, rid: str) -> bool:
        """Abort a queued or running request, every attempt of it (`protocol.attempt_rid`); its KV is
        released at the next step boundary."""
        with self._lock:
            keys = [key for key in self._streams if is_attempt_of(key, rid)]
        for key in keys:
            self._inbox.put(AbortRequest(key))
        return bool(keys)

    def flush_cache(self) -> bool:
        """Drop every cached prefix; refused (False) while requests are in flight. Blocks until the
        engine thread answers (between steps): call it off any event loop."""
        return self._ask(FlushCache)

    def cache_summary(
        self, max_tokens: int = 1 << 20, lower: bool = False
    ) -> list[tuple[str | None, list[int]]]:
        """The cached prefixes as (namespace, token list) pairs, most recently used first, for
        the router's tree; `lower`: those that end in the host or disk tier. Blocks like
        `flush_cache`."""
        return self._ask(lambda fut: CacheSummary(max_tokens, fut, lower))

    def rank_transfers_open(self) -> int:
        """The KV transfers a prefill or decode replica's tensor-parallel followers hold open: 0
        at idle (the idle invariant on every rank). Blocks like `flush_cache`."""
        return self._ask(RankTransfersOpen)

    def _ask(self, command: Callable[[Future], Any], timeout: float = ASK_TIMEOUT_S) -> Any:
        """Send the engine thread a command that it answers through a future, and wait for the
        answer (off any event loop). An engine whose loop has ended (shut down, or stopped by a
        failed rank) answers nothing: EngineError at once, not after the timeout."""
        fut: Future = Future()
        self._put(command(fut))
        deadline = time.monotonic() + timeout
        while True:
            try:
                return fut.result(timeout=ASK_POLL_S)
            except TimeoutError:
                if not self._thread.is_alive() and not fut.done():
                    raise EngineError(self._ended_message()) from None
                if time.monotonic() > deadline:
                    raise

    def _ended_message(self) -> str:
        return "engine shut down" if self._failure is None else f"the engine has stopped: {self._failure}"

    @property
    def context_length(self) -> int:
        return self.core.context_length

    def stats(self) -> dict[str, Any]:
        return self.core.stats()

    def replica_stats(self) -> ReplicaStats:
        return ReplicaStats(
            **{k: v for k, v in self.core.stats().items() if k in ReplicaStats.__dataclass_fields__},
            lora_adapters=self.lora_adapters(),
            lora_loaded=self.loaded_lora_adapters(),
        )

    def check_health(self) -> None:
        """Raise EngineError if the engine can no longer serve: its loop ended without a
        shutdown (a tensor-parallel rank died, say)."""
        if (failure := self._stopped_by()) is not None:
            raise EngineError(f"the engine has stopped: {failure}")
        if not self._stopped and not self._thread.is_alive():
            raise EngineError("the engine loop is not running")

    def _stopped_by(self) -> str | None:
        # The group's failure is known (to any thread) as soon as a step finds it, a moment
        # before the loop sees it and stops.
        return self._failure or self.core.rank_failed()

    def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._inbox.put(Stop())
        self._thread.join(timeout=30)

    def __del__(self) -> None:  # best effort: a forgotten engine must not keep its thread busy
        try:
            self.shutdown()
        except Exception:
            pass

    # High-level API --------------------------------------------------------------------------
    # LoRA adapters (thread-safe) ----------------------------------------------------------------
    def load_lora_adapter(self, name: str, path: str) -> None:
        """Serve the adapter at `path` as `name` (reads and checks it on the calling thread: call
        it off any event loop); raises LoRAError (a ValueError) for one this engine cannot serve."""
        if self.core.lora is None:
            raise InvalidRequest("this engine runs no LoRA adapters (start it with enable_lora)", "lora")
        self.core.lora.register(name, path)

    def unload_lora_adapter(self, name: str) -> bool:
        """Stop serving `name` (running requests finish with it); False if it was not served."""
        return self.core.lora is not None and self.core.lora.unregister(name)

    def lora_adapters(self) -> dict[str, str]:
        """The adapters served, {name: path}."""
        return {} if self.core.lora is None else self.core.lora.registered()

    def loaded_lora_adapters(self) -> list[str]:
        """Names of the adapters in memory, least recently used first."""
        return [] if self.core.lora is None else self.core.lora.loaded()

    def lora_ref(self, name: str) -> LoRARef:
        path = self.lora_adapters().get(name)
        if path is None:
            raise InvalidRequest(f"no LoRA adapter named {name!r} is loaded", "lora_path")
        return LoRARef(name, path)

    # High-level API --------------------------------------------------------------------------
    def _requests(
        self, prompt, sampling_params, input_ids, lora_path=None
    ) -> tuple[list[GenerateRequest], bool]:
        if (prompt is None) == (input_ids is None):
            raise InvalidRequest("give exactly one of prompt or input_ids", "prompt")
        batched = isinstance(prompt, list) or (
            input_ids is not None and input_ids and isinstance(input_ids[0], list)
        )
        if input_ids is None:
            prompts = prompt if isinstance(prompt, list) else [prompt]
            id_lists = [self.tokenizer.encode(p) for p in prompts]
        else:
            id_lists = input_ids if batched else [input_ids]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(id_lists)
        if len(params) != len(id_lists):
            raise InvalidRequest("sampling_params list must match the number of prompts", "sampling_params")
        loras = lora_path if isinstance(lora_path, list) else [lora_path] * len(id_lists)
        if len(loras) != len(id_lists):
            raise InvalidRequest("lora_path list must match the number of prompts", "lora_path")
        reqs = [
            GenerateRequest(
                input_ids=list(ids),
                sampling_params=SamplingParams.from_dict(p),
                lora=None if name is None else self.lora_ref(name),
            )
            for ids, p, name in zip(id_lists, params, loras)
        ]
        return reqs, batched

    async def _collect(self, request: GenerateRequest) -> list[dict[str, Any]]:
        outs: dict[int, dict[str, Any]] = {}
        async for chunk in self.submit(request):
            _merge(
                outs.setdefault(chunk.index, _empty_result(request.rid)),
                chunk,
                self.tokenizer,
                request.input_ids,
            )
        return [outs[i] for i in sorted(outs)]

    async def async_generate(
        self, prompt=None, sampling_params=None, input_ids=None, stream: bool = False, lora_path=None
    ):
        """Returns the result dict (a list for batched input or n > 1); with stream=True an async
        iterator of cumulative result dicts, one per new chunk. `lora_path`: the name of a loaded
        adapter (or one per prompt, None for the base model)."""
        reqs, batched = self._requests(prompt, sampling_params, input_ids, lora_path)
        if stream:
            if len(reqs) != 1:
                raise InvalidRequest("streaming takes a single prompt", "prompt")
            return self._stream(reqs[0])
        results = await asyncio.gather(*(self._collect(r) for r in reqs))
        flat = [o for r in results for o in r]
        return flat if batched or len(flat) > 1 else flat[0]

    async def _stream(self, request: GenerateRequest) -> AsyncIterator[dict[str, Any]]:
        outs: dict[int, dict[str, Any]] = {}
        request.stream = True
        async for chunk in self.submit(request):
            out = outs.setdefault(chunk.index, _empty_result(request.rid))
            _merge(out, chunk, self.tokenizer, request.input_ids)
            yield dict(out, index=chunk.index, meta_info=dict(out["meta_info"]))

    def generate(self, prompt=None, sampling_params=None, input_ids=None, lora_path=None):
        """Synchronous generate; same return shape as `async_generate`."""
        loop = asyncio.new_event_loop()
        try:
            return loop.run_until_complete(
                self.async_generate(prompt, sampling_params, input_ids, lora_path=lora_path)
            )
        finally:
            loop.close()

    # The loop --------------------------------------------------------------------------------
    def _loop(self) -> None:
        self.core.worker.init_engine_thread()
        while True:
            try:
                if not self._drain_inbox(self.core.idle_timeout()):
                    break
                self.core.step(self._deliver)
            except Exception as exc:  # a bug outside any request's own work: fail them all loudly
                logger.exception("engine step failed")
                self._deliver(self.core.fail_all(f"internal engine error: {exc!r}"))
            failure = self.core.rank_failure()
            if failure is not None:
                logger.error("the engine stops: %s", failure)
                with self._lock:
                    self._failure = failure
                break
        message = self._ended_message()
        self._deliver(self.core.fail_all(message))
        with self._lock:  # submitted, but never seen by the loop (still in the inbox)
            self._closed = True  # from here on nothing registers, and a command put is refused
            unanswered = [(rid, EngineError(message)) for rid in self._streams]
        self._deliver(unanswered)
        self._refuse_inbox(message)
        self.core.close()
        self._refuse_inbox(message)  # what came in meanwhile

    def _refuse_inbox(self, message: str) -> None:
        """The loop has ended: the commands still queued get no answer but this one."""
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            done = getattr(cmd, "done", None)
            if isinstance(done, Future) and done.set_running_or_notify_cancel():
                done.set_exception(EngineError(message))

    def _put(self, command: Any) -> None:
        """Queue a command for the loop. One queued after the loop's last look at its inbox is
        refused here (the loop sets `_closed` before it looks)."""
        self._inbox.put(command)
        if self._closed:
            self._refuse_inbox(self._ended_message())

    def _drain_inbox(self, timeout: float | None) -> bool:
        """Run pending commands; wait up to `timeout` for the first one (None: do not wait).
        False once a Stop command came."""
        while True:
            try:
                cmd = self._inbox.get(timeout=timeout) if timeout else self._inbox.get_nowait()
            except queue.Empty:
                return True
            timeout = None
            if not self.core.handle(cmd):
                return False

    def _deliver(self, items: list) -> None:
        """items: (rid, OutputChunk | Exception). Groups per event loop, one wake-up each."""
        if not items:
            return
        per_loop: dict[Any, list] = defaultdict(list)
        with self._lock:
            for rid, item in items:
                stream = self._streams.get(rid)
                if stream is None:
                    continue
                per_loop[stream.loop].append((stream, item))
                if isinstance(item, BaseException):
                    self._open_sequences -= stream.n - stream.finals_sent
                    del self._streams[rid]
                elif item.finished:
                    stream.finals_sent += 1
                    self._open_sequences -= 1
                    if stream.finals_sent >= stream.n:
                        del self._streams[rid]
        for loop, batch in per_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:
                pass  # the consumer's loop is closed: nobody is listening any more


def _check_queue_room(n: int, queued: int, limit: int) -> None:
    """`max_queued_requests` counts sequences: a request with n = 8 takes 8 places."""
    if n > limit:
        raise InvalidRequest(
            f"n={n} sequences can never be queued on this replica: its queue holds {limit} sequences",
            "n",
        )
    if queued + n > limit:
        raise QueueFull(
            f"the request queue is full ({queued} of {limit} sequences waiting, {n} asked); retry later"
        )


def _put_all(batch: list) -> None:
    for stream, item in batch:
        stream.queue.put_nowait(item)


def _empty_result(rid: str) -> dict[str, Any]:
    return native_result(rid)


def _merge(
    out: dict[str, Any], chunk: OutputChunk, tokenizer: Any, input_ids: list[int] | None = None
) -> None:
    """Logprob triples carry the token's text: the engine has the tokenizer (SGLang fills it only
    with return_text_in_logprobs; here it is always there)."""
    add_to_native_result(out, chunk, lambda t: tokenizer.decode([t], skip_special_tokens=False), input_ids)
