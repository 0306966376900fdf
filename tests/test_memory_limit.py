"""A replica's memory budget: the kernel refuses its allocations past the budget, the request
that asked fails alone, and the engine goes on serving. Each case runs in a process of its own
(the limit stays with the process)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from radixserve.cluster import app
from radixserve.cluster.config import ServerArgs, parse_cli


def run(code: str, timeout: float = 600) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_allocations_past_the_budget_fail_and_smaller_ones_still_succeed():
    out = run(
        """
        from radixserve.workers.executor.memory_limit import address_space_bytes, limit_memory_growth
        before = address_space_bytes()
        limit = limit_memory_growth(256 << 20)
        assert before + (256 << 20) - (8 << 20) <= limit <= before + (256 << 20) + (8 << 20), (before, limit)
        try:
            hog = bytearray(512 << 20)
        except MemoryError:
            print("refused")
        ok = bytearray(64 << 20)
        print("still allocates", len(ok) >> 20)
        """
    )
    assert out.split("\n")[:2] == ["refused", "still allocates 64"]


@pytest.mark.timeout(700)
def test_a_request_that_allocates_without_end_fails_alone():
    """A request whose work allocates past the replica's budget (here: the fault hook, in its
    token stage) gets an EngineError; the request beside it finishes and the KV is all back."""
    out = run(
        """
        import asyncio
        from radixserve.workers import Engine
        from radixserve.workers.executor.memory_limit import limit_memory_growth
        from radixserve.workers.protocol import GenerateRequest, SamplingParams
        from tests.engine_utils import assert_kv_invariant

        engine = Engine(max_total_tokens=2048, num_threads=1)
        limit_memory_growth(1 << 30)

        def hog(stage, req):
            if stage == "tokens" and req.rid == "hog":
                kept = [bytearray(256 << 20) for _ in range(64)]  # 16 GiB, a chunk at a time

        engine.core.worker.fault_hook = hog
        params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}

        async def hogging():
            ids = engine.tokenizer.encode("Hello")
            async for _ in engine.submit(GenerateRequest(ids, SamplingParams(**params), rid="hog")):
                pass

        async def both():
            beside = engine.async_generate("The capital of France is", params)
            return await asyncio.gather(hogging(), beside, return_exceptions=True)

        err, ok = asyncio.run(both())
        print(type(err).__name__, "MemoryError" in str(err))
        print(ok["meta_info"]["completion_tokens"])
        engine.core.worker.fault_hook = None
        print(engine.generate("Hello", params)["meta_info"]["completion_tokens"])
        assert_kv_invariant(engine)
        engine.shutdown()
        """
    )
    assert out.split("\n")[:3] == ["EngineError True", "4", "4"]


def test_the_budget_is_a_ray_reservation_and_reaches_the_replica():
    args = parse_cli(["--replica-memory-gb", "1.5"])
    assert args.deployment.replica_memory_gb == 1.5
    assert app.replica_options(args)["ray_actor_options"]["memory"] == int(1.5 * 2**30)
    assert app.replica_memory_bytes(args) == int(1.5 * 2**30)
    assert "memory" not in app.replica_options(ServerArgs.from_dict({}))["ray_actor_options"]
    assert app.replica_memory_bytes(ServerArgs.from_dict({})) is None
    with pytest.raises(ValueError, match="replica_memory_gb must be > 0"):
        ServerArgs.from_dict({"replica_memory_gb": 0})
