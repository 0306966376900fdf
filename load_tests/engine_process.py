"""An offline Engine in a spawned process of its own, driven from this one.

    prefill = EngineProcess(model_path, role="prefill", tp_size=2)
    chunks = prefill.generate(request)        # every OutputChunk of one request
    stats = prefill.call(some_module.fn)      # fn(engine) there (fn importable), its result here
    prefill.close()

One process holds at most one tensor-parallel group, so two tensor-parallel engines (a prefill
and a decode replica, say) need two processes: the benchmarks and tests that drive PD at
tp_size > 1 without Ray host one of them here. Thread-safe: concurrent calls run concurrently on
the engine's side (one event loop there). Requests and chunks cross by pickle, between processes
of this program only.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

START_TIMEOUT_S = 300.0
CALL_TIMEOUT_S = 120.0


def _serve(conn, model_path: str | None, kwargs: dict[str, Any]) -> None:
    from radixserve.workers import Engine

    engine = Engine(model_path, **kwargs)
    send_lock = threading.Lock()

    def answer(call_id: int, status: str, value: Any) -> None:
        with send_lock:
            conn.send((call_id, status, value))

    async def handle(call_id: int, kind: str, payload: Any) -> None:
        try:
            if kind == "generate":
                answer(call_id, "ok", [c async for c in engine.submit(payload)])
            else:
                answer(call_id, "ok", await asyncio.to_thread(payload, engine))
        except Exception as exc:
            answer(call_id, "error", f"{type(exc).__name__}: {exc}")

    async def loop() -> None:
        tasks: set[asyncio.Task] = set()
        answer(0, "ok", None)
        running = asyncio.get_running_loop()
        while (msg := await running.run_in_executor(None, conn.recv)) is not None:
            task = asyncio.create_task(handle(*msg))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)

    try:
        asyncio.run(loop())
    finally:
        engine.shutdown()


class EngineProcess:
    def __init__(self, model_path: str | None = None, **engine_kwargs: Any):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, model_path, engine_kwargs), name="engine")
        self.process.start()
        self._lock = threading.Lock()
        self._next_id = 1
        ready: Future = Future()
        self._waiting: dict[int, Future] = {0: ready}
        threading.Thread(target=self._read, name="engine-process-reader", daemon=True).start()
        ready.result(START_TIMEOUT_S)

    def _read(self) -> None:
        try:
            while True:
                call_id, status, value = self.conn.recv()
                with self._lock:
                    fut = self._waiting.pop(call_id)
                if status == "error":
                    fut.set_exception(RuntimeError(value))
                else:
                    fut.set_result(value)
        except (EOFError, OSError):  # the process ended
            with self._lock:
                waiting, self._waiting = self._waiting, {}
            for fut in waiting.values():
                fut.set_exception(
                    RuntimeError(f"the engine process ended (exit code {self.process.exitcode})")
                )

    def _call(self, kind: str, payload: Any, timeout: float) -> Any:
        fut: Future = Future()
        with self._lock:
            call_id, self._next_id = self._next_id, self._next_id + 1
            self._waiting[call_id] = fut
            self.conn.send((call_id, kind, payload))
        return fut.result(timeout)

    def generate(self, request: Any, timeout: float = CALL_TIMEOUT_S) -> list:
        """Every chunk of `request` (a GenerateRequest); an error there raises RuntimeError."""
        return self._call("generate", request, timeout)

    def call(self, fn: Callable[[Any], Any], timeout: float = CALL_TIMEOUT_S) -> Any:
        """fn(engine) on a thread of the engine's process (fn importable: a module-level one)."""
        return self._call("call", fn, timeout)

    def close(self) -> None:
        """Stop the engine and its process; a second call does nothing."""
        with self._lock:
            if self.process.exitcode is not None:
                return
            self.conn.send(None)
        self.process.join(60)
        if self.process.exitcode is None:
            self.process.kill()
            self.process.join(10)
