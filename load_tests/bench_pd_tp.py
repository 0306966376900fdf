"""PD at tensor parallelism 2 against 1, and between the two: the first token and the hand-off
(first token -> second token) of the default model, for prompts of fresh random tokens.

    python -m load_tests.bench_pd_tp                       # ~3 minutes on 2 cores
    python -m load_tests.bench_pd_tp --prompt-tokens 1000 4000 --repeats 5 --json results/pd_tp.json

Without Ray. Each pair is a prefill engine in a process of its own (load_tests/engine_process.py:
one tensor-parallel group per process) and a decode engine in this one, over loopback gloo:
  tp1  one rank per engine, two torch threads
  tp2  two ranks per engine, one torch thread each; every rank sends its own heads (2 + 1 of the
       default model's 3 KV heads) straight to the same rank of the decode engine
  tp2->tp1  the tp2 prefill engine into a tp1 decode engine (--prefill-tp 2 --decode-tp 1): the
       decode rank takes KV heads 0-1 from prefill rank 0 and head 2 from rank 1, two transfers
Requests alternate between the pairs (only one pair computes at a time) and ask for 3 tokens.
Both pairs are timed the same way: the first token is when the prefill engine's answer is back
here (its request ends with that token), the second and third when the decode engine streams
them. Reported per prompt length and layout (medians): ttft, handoff (first -> second token: the
rest of the transfer, the admission once every rank's part is in, one decode step) and
decode_step (second -> third token: one decode step alone).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import statistics
import time
from typing import Any

from load_tests.bench_handoff import report
from load_tests.engine_process import EngineProcess
from radixserve.workers import Engine
from radixserve.workers.protocol import GenerateRequest, SamplingParams


def flush(engine: Engine) -> bool:
    return engine.flush_cache()


async def one(prefill: EngineProcess, decode: Engine, ids: list[int]) -> tuple[float, float, float]:
    """(ttft, handoff, step): submit -> first token, first -> second, second -> third."""
    req = GenerateRequest(ids, SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True), stream=True)
    t0 = time.perf_counter()
    dstream, done = decode.reserve(req)
    tickets = await asyncio.wrap_future(done)
    chunks = await asyncio.to_thread(prefill.generate, dataclasses.replace(req, kv_tickets=tickets))
    first = time.perf_counter()
    assert sum(len(c.token_ids) for c in chunks) == 1, "the prefill engine answers with one token"
    times = []
    async for chunk in dstream:
        times += [time.perf_counter()] * len(chunk.token_ids)
    assert len(times) == 2, "the decode engine streams the second and third tokens"
    return first - t0, times[0] - first, times[1] - times[0]


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[1000, 4000])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    common: dict[str, Any] = dict(max_total_tokens=16384, kv_transfer="gloo")
    layouts = {"tp1": dict(tp_size=1, num_threads=2), "tp2": dict(tp_size=2, num_threads=1)}
    pairs: dict[str, tuple[EngineProcess, Engine]] = {}
    rows = []
    try:
        for name, layout in layouts.items():
            prefill = EngineProcess(role="prefill", **common, **layout)
            pairs[name] = (prefill, Engine(role="decode", **common, **layout))
        # The tp2 prefill engine serves a second decode engine too (one pair computes at a time).
        pairs["tp2->tp1"] = (
            pairs["tp2"][0],
            Engine(role="decode", kv_peer_tp_size=2, **common, **layouts["tp1"]),
        )
        vocab = pairs["tp1"][1].core.model_config.vocab_size
        rng = random.Random(0)
        for prefill, decode in pairs.values():  # warm-up: pairs set up, kernels touched
            asyncio.run(one(prefill, decode, [rng.randrange(100, vocab) for _ in range(64)]))
        for n in args.prompt_tokens:
            samples: dict[str, list[tuple[float, float, float]]] = {name: [] for name in pairs}
            for _ in range(args.repeats):
                for name, (prefill, decode) in pairs.items():
                    ids = [rng.randrange(100, vocab) for _ in range(n)]
                    samples[name].append(asyncio.run(one(prefill, decode, ids)))
                    decode.flush_cache()  # the next prompt finds nothing either way
                    prefill.call(flush)
            for name, xs in samples.items():
                rows.append(
                    {
                        "prompt_tokens": n,
                        "layout": name,
                        "ttft_ms": round(statistics.median(x[0] for x in xs) * 1000, 1),
                        "handoff_ms": round(statistics.median(x[1] for x in xs) * 1000, 1),
                        "handoff_min_ms": round(min(x[1] for x in xs) * 1000, 1),
                        "decode_step_ms": round(statistics.median(x[2] for x in xs) * 1000, 1),
                    }
                )
    finally:
        for prefill, decode in pairs.values():
            decode.shutdown()
            prefill.close()  # closing twice is a no-op
    columns = [("prompt_tokens", "tokens"), ("layout", "layout"), ("ttft_ms", "ttft ms")]
    columns += [("handoff_ms", "handoff ms"), ("handoff_min_ms", "(min)"), ("decode_step_ms", "step ms")]
    report(rows, columns, args.json)
    return rows


if __name__ == "__main__":
    main()
