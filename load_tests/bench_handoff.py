"""PD hand-off latency: from the first token (the prefill replica's) to the second (the decode
replica's), with the prefill side sending each layer of the last chunk as its forward writes it
(`kv_transfer_layerwise`, the default) against sending the whole prompt after the forward.

    python -m load_tests.bench_handoff                          # ~3 minutes on 2 cores
    python -m load_tests.bench_handoff --prompt-tokens 1000 4000 --repeats 5 --json results/h.json

In one process, without Ray: two prefill engines (layerwise on, off) and one decode engine of the
default model, one torch thread each, over loopback gloo; driven as the ingress drives them
(reserve on decode, prefill with the tickets, the first token from prefill, the rest from
decode). Each request has a prompt of fresh random tokens (nothing cached on either side) and
asks for 2 tokens; the modes alternate. Reported per prompt length and mode (medians):
  ttft     submit -> the first token (the prefill forward; the transfer runs alongside it when
           layerwise)
  handoff  first token -> second token: what is left of the transfer, the decode side's
           admission, and one decode step
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import statistics
import time

from radixserve.workers import Engine
from radixserve.workers.protocol import GenerateRequest, SamplingParams


async def one(prefill: Engine, decode: Engine, ids: list[int]) -> tuple[float, float]:
    req = GenerateRequest(ids, SamplingParams(max_new_tokens=2, temperature=0, ignore_eos=True), stream=True)
    t0 = time.perf_counter()
    dstream, done = decode.reserve(req)
    tickets = await asyncio.wrap_future(done)
    first = second = None
    async for chunk in prefill.submit(dataclasses.replace(req, kv_tickets=tickets)):
        if chunk.token_ids and first is None:
            first = time.perf_counter()
    async for chunk in dstream:
        if chunk.token_ids and second is None:
            second = time.perf_counter()
    assert first is not None and second is not None, "no first or second token"
    return first - t0, second - first


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[1000, 4000])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--chunked-prefill-size", type=int, default=2048)
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    common = dict(num_threads=1, max_total_tokens=32768, chunked_prefill_size=args.chunked_prefill_size)
    common.update(kv_transfer="gloo")
    decode = Engine(role="decode", **common)
    prefills = {
        "layerwise": Engine(role="prefill", kv_transfer_layerwise=True, **common),
        "after": Engine(role="prefill", kv_transfer_layerwise=False, **common),
    }
    rng = random.Random(0)
    vocab = decode.core.model_config.vocab_size
    rows = []
    try:
        for engine in prefills.values():  # warm-up: pairs set up, kernels touched
            asyncio.run(one(engine, decode, [rng.randrange(100, vocab) for _ in range(64)]))
        for n in args.prompt_tokens:
            samples: dict[str, list[tuple[float, float]]] = {m: [] for m in prefills}
            for _ in range(args.repeats):
                for mode, engine in prefills.items():
                    ids = [rng.randrange(100, vocab) for _ in range(n)]
                    samples[mode].append(asyncio.run(one(engine, decode, ids)))
                    decode.flush_cache()  # the next prompt finds nothing either way
                    engine.flush_cache()
            for mode, xs in samples.items():
                rows.append(
                    {
                        "prompt_tokens": n,
                        "mode": mode,
                        "ttft_ms": round(statistics.median(x[0] for x in xs) * 1000, 1),
                        "handoff_ms": round(statistics.median(x[1] for x in xs) * 1000, 1),
                        "handoff_min_ms": round(min(x[1] for x in xs) * 1000, 1),
                    }
                )
    finally:
        for e in (decode, *prefills.values()):
            e.shutdown()
    columns = [("prompt_tokens", "tokens"), ("mode", "mode"), ("ttft_ms", "ttft ms")]
    report(rows, [*columns, ("handoff_ms", "handoff ms"), ("handoff_min_ms", "(min)")], args.json)
    return rows


def report(rows: list[dict], columns: list[tuple[str, str]], json_path: str | None) -> None:
    """Print the rows as a table of (key, heading) columns; write them to json_path too."""
    widths = [max(len(heading), *(len(str(r[key])) for r in rows)) for key, heading in columns]
    print(" ".join(f"{heading:>{w}}" for (_key, heading), w in zip(columns, widths)))
    for r in rows:
        print(" ".join(f"{r[key]!s:>{w}}" for (key, _heading), w in zip(columns, widths)))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
