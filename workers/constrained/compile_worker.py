"""A grammar compile running in a child process, so that it can be stopped.

xgrammar cannot interrupt a compile, and one thread stuck in a pathological grammar keeps a core
busy for minutes. Here parsing, checking and compiling all run in a worker process; the parent
kills it when a compile overruns and starts a fresh one. Results come back as
`CompiledGrammar.serialize_json()` text.

The worker is a fresh interpreter (fork + exec of `sys.executable`), never a bare fork: the parent
is a replica with live threads (the engine loop, Ray's and torch's pools), and a forked child would
inherit their locks in whatever state they were in. It is started with subprocess rather than
multiprocessing's "spawn", which re-imports the parent's `__main__` in the child: an offline script
without a main guard would build its engine again in there, and a Ray worker's main module imports
all of Ray. Its parent is the replica itself, so it can tell when the replica is gone (see
`_exit_with_parent`). The ~2 s a start takes (importing xgrammar pulls in torch) is paid at the
first compile and after a kill, on the thread that drives the worker, and never counts against a
compile's timeout.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

import xgrammar as xgr

from radixserve.workers.constrained.parser import clean_error, parse_grammar
from radixserve.workers.protocol import InvalidRequest

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 120.0  # importing xgrammar on a busy host; a stuck start is killed
PARENT_CHECK_S = 0.5


@dataclass(frozen=True)
class WorkerSetup:
    """Sent once to a new worker: the vocabulary as xgrammar sees it (TokenizerInfo JSON)."""

    text_info: str  # for regex and EBNF
    json_info: str  # for JSON schemas
    any_whitespace: bool


@dataclass(frozen=True)
class CompileJob:
    kind: str
    text: str
    reasoning: str | None = None  # the answer follows this convention's thinking

    @property
    def free_text(self) -> bool:
        """Compiled against the vocabulary for free text: a regex, an EBNF, or any grammar after
        thinking (which may hold newlines and control characters)."""
        return self.kind != "json_schema" or self.reasoning is not None


@dataclass(frozen=True)
class CompileResult:
    """A compiled grammar (`grammar_json`), or the InvalidRequest that refused it (the rest)."""

    grammar_json: str = ""
    message: str = ""
    param: str | None = None
    code: str | None = None

    def error(self) -> InvalidRequest | None:
        return InvalidRequest(self.message, self.param, self.code) if self.message else None


class WorkerGone(RuntimeError):
    """The worker process exited or could not start; `exitcode` as subprocess reports it (-9:
    killed by SIGKILL), None if it was never reaped."""

    def __init__(self, message: str, exitcode: int | None = None):
        super().__init__(message)
        self.exitcode = exitcode


class CompileTimeout(RuntimeError):
    """The compile overran its timeout; the worker was killed."""


class CompileWorker:
    """The parent's handle on one worker process. `start` and `compile` are called from one
    driver thread; `kill` and `close` may come from any thread (they interrupt a running compile)."""

    def __init__(self, setup: WorkerSetup):
        self._setup = setup
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._ready = False
        self._closed = False
        self.starts = 0  # processes started, replacements included

    @property
    def pid(self) -> int | None:
        """The live worker's pid, None while there is none."""
        process = self._process
        return process.pid if process is not None else None

    def start(self) -> None:
        """Start a worker unless one is ready; blocks until it is (its imports take seconds)."""
        if self._ready:
            return
        with self._lock:
            if self._closed:
                raise WorkerGone("the compile worker is closed")
            self._kill_locked()
            if self._conn is not None:
                self._conn.close()  # here, not in kill: only the driver thread reads it
            try:
                ours, theirs = socket.socketpair()
            except OSError as exc:
                raise WorkerGone(f"the compile worker failed to start: {exc}") from None
            try:
                process = subprocess.Popen(
                    [
                        sys.executable,
                        "-c",
                        _BOOT,
                        json.dumps(sys.path),
                        str(theirs.fileno()),
                        str(os.getpid()),
                    ],
                    stdin=subprocess.DEVNULL,
                    pass_fds=(theirs.fileno(),),
                )
            except OSError as exc:  # out of processes, file descriptors or memory
                ours.close()
                raise WorkerGone(f"the compile worker failed to start: {exc}") from None
            finally:
                theirs.close()
            self._process, self._conn = process, Connection(ours.detach())
            self.starts += 1
            conn = self._conn
        try:
            conn.send(self._setup)
            if not conn.poll(STARTUP_TIMEOUT_S):
                raise WorkerGone(f"no answer within {STARTUP_TIMEOUT_S:g}s")
            conn.recv()  # the worker's "ready"
        except (OSError, EOFError, WorkerGone) as exc:
            self.kill()
            raise WorkerGone(f"the compile worker failed to start: {exc}", process.returncode) from None
        self._ready = True

    def compile(self, job: CompileJob, timeout_s: float) -> CompileResult:
        """Run one job on the started worker. Raises CompileTimeout (worker killed) or WorkerGone
        (it died, e.g. out of memory, or was stopped by `kill` / `close`)."""
        process, conn = self._process, self._conn
        try:
            if not self._ready or conn is None:
                raise OSError("not started")
            conn.send(job)
            if conn.poll(timeout_s):
                return conn.recv()
        except (OSError, EOFError):
            self.kill()  # reaps it, so that its exit code is known
            exitcode = process.returncode if process is not None else None
            raise WorkerGone(f"the compile worker exited (exit code {exitcode})", exitcode) from None
        self.kill()
        raise CompileTimeout(f"no result within {timeout_s:g}s")

    def kill(self) -> None:
        """Stop the process now (SIGKILL: a compile does not yield); `start` makes a new one."""
        with self._lock:
            self._kill_locked()

    def close(self) -> None:
        """Kill the process for good: `start` refuses from now on."""
        with self._lock:
            self._closed = True
            self._kill_locked()

    def _kill_locked(self) -> None:
        self._ready = False
        if self._process is None:
            return
        self._process.kill()
        try:
            self._process.wait(timeout=10)  # reap it: SIGKILL cannot be caught, so this is quick
        except subprocess.TimeoutExpired:  # stuck in the kernel; subprocess reaps it later
            logger.error("grammar compile worker %d did not exit after SIGKILL", self._process.pid)
        self._process = None


# ---- the worker process --------------------------------------------------------------------------


# The child's whole command line: the parent's sys.path (Ray may have extended it), then serve().
_BOOT = (
    "import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
    "from radixserve.workers.constrained.compile_worker import serve; "
    "serve(int(sys.argv[2]), int(sys.argv[3]))"
)


def serve(fd: int, parent_pid: int) -> None:
    """The worker's main loop: one CompileJob in, one CompileResult out, until the socket closes."""
    conn = Connection(fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the group; the parent decides
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    setup: WorkerSetup = conn.recv()
    infos = {
        "text": xgr.TokenizerInfo.deserialize_json(setup.text_info),
        "json": xgr.TokenizerInfo.deserialize_json(setup.json_info),
    }
    compilers = {
        name: xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False) for name, info in infos.items()
    }
    conn.send("ready")
    while True:
        try:
            job: CompileJob = conn.recv()
        except EOFError:
            return
        compiler = compilers["text" if job.free_text else "json"]
        conn.send(_compile(compiler, job, setup.any_whitespace))


def _compile(compiler: xgr.GrammarCompiler, job: CompileJob, any_whitespace: bool) -> CompileResult:
    try:
        grammar = parse_grammar(job.kind, job.text, any_whitespace, job.reasoning)
        return CompileResult(grammar_json=compiler.compile_grammar(grammar).serialize_json())
    except InvalidRequest as exc:
        return CompileResult(message=exc.message, param=exc.param, code=exc.code)
    except Exception as exc:  # xgrammar raises RuntimeError for what the parser let through
        message = f"{job.kind} failed to compile: {clean_error(exc)}"
        return CompileResult(message=message, param=job.kind, code="invalid_grammar")


def _exit_with_parent(parent_pid: int) -> None:
    # The main thread may be deep in a compile that never looks at the pipe; once the parent is
    # gone (this process is re-parented), nobody will read the result or kill it.
    while os.getppid() == parent_pid:
        time.sleep(PARENT_CHECK_S)
    os._exit(0)
