"""GrammarBackend's compile worker processes: a compile past its timeout is killed (its core
freed) and the worker replaced; a worker that dies is replaced; `submit` never parses or compiles
in the caller; the pending queue is bounded; `close()` and the death of the parent stop the
workers."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import xgrammar as xgr

from radixserve.workers.constrained import parser
from radixserve.workers.constrained.grammar_backend import GrammarBackend
from radixserve.workers.protocol import EngineError, InvalidRequest, QueueFull
from tests.test_grammar import _load_tokenizer, nested_arrays

# Each segment takes ~2 s to compile on one core, so this runs far past the 1 s timeouts below.
SLOW = "x".join(['[^"]{0,3000}'] * 10)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tok():
    return _load_tokenizer()


def wait_for(condition, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def gone(pid: int) -> bool:
    """No such process, or one that has exited and waits to be reaped (it uses no CPU)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_timed_out_compile_is_killed_and_the_worker_replaced(tok):
    with GrammarBackend(tok, len(tok), compile_timeout_s=1.0) as backend:
        slow = backend.submit("regex", SLOW)
        queued = backend.submit("regex", "(yes|no)")  # behind the slow one on the only worker
        wait_for(lambda: backend.stats().running == 1)
        [pid] = backend.worker_pids()
        with pytest.raises(InvalidRequest) as err:
            slow.result(timeout=120)
        assert err.value.code == "grammar_compile_timeout" and err.value.param == "regex"
        assert err.value.message == "the regex grammar took longer than 1s to compile; simplify it"
        assert gone(pid)  # killed and reaped before the future was settled: its core is free
        assert queued.result(timeout=120) is not None  # compiled by the replacement
        assert backend.worker_pids() and backend.worker_pids()[0] != pid
        again = backend.submit("regex", SLOW)  # remembered for a while: refused at once
        assert again.done() and again.exception().code == "grammar_compile_timeout"
        stats = backend.stats()
        assert (stats.compiles, stats.timeouts, stats.failures, stats.workers_started) == (2, 1, 1, 2)


def test_worker_that_dies_fails_its_compile_and_is_replaced(tok):
    with GrammarBackend(tok, len(tok), compile_timeout_s=600) as backend:
        slow = backend.submit("regex", SLOW)
        wait_for(lambda: backend.stats().running == 1)
        [pid] = backend.worker_pids()
        os.kill(pid, signal.SIGKILL)  # as the kernel's OOM killer would
        with pytest.raises(InvalidRequest) as err:
            slow.result(timeout=120)
        assert (err.value.code, err.value.param) == ("grammar_compile_failed", "regex")
        assert "exit code -9" in err.value.message
        assert backend.submit("regex", "(yes|no)").result(timeout=120) is not None
        stats = backend.stats()
        assert (stats.worker_deaths, stats.failures, stats.workers_started) == (1, 1, 2)


def test_submit_does_no_parsing_or_compiling_in_the_caller(tok, monkeypatch):
    with GrammarBackend(tok, len(tok), compile_timeout_s=1.0) as backend:

        def forbidden(*args, **kwargs):
            raise AssertionError("grammar work on the caller's thread")

        # The worker is another interpreter: these patches reach only this process.
        for owner, name in [
            (parser, "parse_grammar"),
            (parser, "check_json_schema"),
            (parser.json, "loads"),
            (xgr.Grammar, "from_json_schema"),
            (xgr.Grammar, "from_regex"),
            (xgr.GrammarCompiler, "compile_grammar"),
        ]:
            monkeypatch.setattr(owner, name, forbidden)
        busy = backend.submit("regex", SLOW)  # the worker is busy: everything below waits
        pathological = [
            nested_arrays(900),
            '{"items": ' * 5000 + "{}" + "}" * 5000,
            "[" * 100_000 + "]" * 100_000,
        ]
        started = time.perf_counter()
        futures = [backend.submit("json_schema", text) for text in pathological]
        assert time.perf_counter() - started < 0.5  # generous: each submit only queues a job
        assert not any(f.done() for f in futures)
        assert busy.exception(timeout=120).code == "grammar_compile_timeout"
        for future in futures:
            assert future.exception(timeout=120).code == "schema_too_deep"


def test_pending_compiles_are_bounded_and_close_fails_them(tok):
    backend = GrammarBackend(tok, len(tok), max_pending=2, compile_timeout_s=600)
    slow = backend.submit("regex", SLOW)
    wait_for(lambda: backend.stats().running == 1)
    a, b = backend.submit("regex", "a+"), backend.submit("regex", "b+")
    refused = backend.submit("regex", "c+")
    assert refused.done() and isinstance(refused.exception(), QueueFull)
    assert str(refused.exception()) == "2 grammars are already waiting to compile; retry later"
    assert backend.submit("regex", "a+") is a  # joining a queued compile takes no new place
    stats = backend.stats()
    assert (stats.running, stats.pending, stats.refused, stats.compiles) == (1, 2, 1, 3)
    [pid] = backend.worker_pids()
    backend.close()
    assert gone(pid) and backend.worker_pids() == []
    for future in (slow, a, b):
        assert isinstance(future.exception(timeout=10), EngineError)
    after = backend.submit("regex", "(yes|no)")
    assert after.done() and isinstance(after.exception(), EngineError)
    assert backend.submit("regex", "c+").done()  # nothing queued any more, nothing started
    backend.close()  # idempotent
    assert backend.stats().pending == 0 and backend.stats().workers_started == 1


PARENT = """
import sys, time
from radixserve.workers.constrained.grammar_backend import GrammarBackend
from tests.test_grammar import _load_tokenizer
tok = _load_tokenizer()
backend = GrammarBackend(tok, len(tok), compile_timeout_s=600)
backend.submit("regex", sys.argv[1])
while backend.stats().running == 0:
    time.sleep(0.01)
print("worker", backend.worker_pids()[0], flush=True)
sys.stdin.read()  # until killed
"""


def test_workers_exit_when_their_parent_dies():
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, SLOW],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = ""
        while not line.startswith("worker "):
            line = parent.stdout.readline()
            assert line, "the parent exited early"
        pid = int(line.split()[1])
        assert not gone(pid) and psutil.Process(pid).ppid() == parent.pid
    finally:
        parent.kill()  # SIGKILL: no close(), no atexit hook, nothing but the worker's own watch
        parent.wait(timeout=30)
    wait_for(lambda: gone(pid), timeout_s=30)


def test_compiled_grammar_survives_the_trip_between_processes(tok):
    with GrammarBackend(tok, len(tok)) as backend:
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
        matcher = backend.new_matcher(backend.submit("json_schema", json.dumps(schema)).result(timeout=120))
        for token in tok.encode('{"ok": true}'):
            assert matcher.accept_token(token)
        assert matcher.accept_token(tok.eos_token_id) and matcher.is_terminated()
