"""Online serving benchmark for any OpenAI-compatible server (SGLang's bench_serving in spirit).

    python -m load_tests.bench_serving --base-url http://127.0.0.1:30000 \
        --dataset generated-shared-prefix --max-concurrency 16
    # side by side, one run:  --base-url radixserve=http://127.0.0.1:30000 --base-url hf=http://127.0.0.1:8000

Streams every request (SSE, `stream_options.include_usage`) to measure TTFT / ITL / TPOT / E2E,
and reads prompt, completion and cached token counts from the server's `usage`. Each run also
prints the machine's floor for the workload (load_tests/floor.py: the prompt tokens no cache can
save at the measured GEMM rate, the decode steps at the measured memory bandwidth) and how many
times it each server took; `--floor-model` names the served model's shape (default: the default
model), `--no-floor` skips it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from load_tests import floor
from load_tests.bench_datasets import Conversation, build


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    text: str = ""


def parse_sse_line(line: str) -> Any | None:
    """The JSON payload of one SSE `data:` line; "[DONE]" for the end; None for other lines."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    return data if data == "[DONE]" else json.loads(data)


async def send(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    messages: list[dict],
    max_tokens: int,
    extra: dict[str, Any],
) -> Result:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    res, start = Result(), time.perf_counter()
    last = start
    chunks = 0
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            async for raw in resp.content:
                event = parse_sse_line(raw.decode("utf-8").strip())
                if event is None or event == "[DONE]":
                    continue
                if "error" in event:
                    res.error = json.dumps(event["error"])[:200]
                    return res
                if event.get("usage"):
                    u = event["usage"]
                    res.prompt_tokens = u.get("prompt_tokens", 0)
                    res.completion_tokens = u.get("completion_tokens", 0)
                    res.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                for choice in event.get("choices") or []:
                    delta = (choice.get("delta") or {}).get("content") or ""
                    if not delta:
                        continue
                    now = time.perf_counter()
                    if chunks == 0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last, chunks = now, chunks + 1
                    res.text += delta
        res.e2e = time.perf_counter() - start
        res.completion_tokens = res.completion_tokens or chunks
        res.ok = True
    except Exception as e:  # a benchmark reports failures, it does not stop at the first
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_conversation(conv: Conversation, go, session, url, model, extra) -> list[Result]:
    out, history = [], []
    for turn in conv.turns:
        async with go():
            messages = history + turn.messages if conv.chained else turn.messages
            r = await send(session, url, model, messages, turn.output_len, extra)
        out.append(r)
        if not r.ok:
            break
        history = messages + [{"role": "assistant", "content": r.text}]
    return out


async def benchmark(url: str, convs: list[Conversation], args) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = aiohttp.ClientTimeout(total=None, sock_read=args.timeout)
    # A connection per request: a server that closes idle keep-alive connections (llama-server
    # does) otherwise fails the next request written into a socket it already closed.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout, connector=connector) as s:
        model = args.model or (await (await s.get(url + "/v1/models")).json())["data"][0]["id"]
        sem = asyncio.Semaphore(args.max_concurrency or 10**9)
        extra = {"ignore_eos": True} if args.ignore_eos else {}
        rng = random.Random(args.seed)
        tasks, start = [], time.perf_counter()
        for conv in convs:
            tasks.append(asyncio.ensure_future(run_conversation(conv, lambda: sem, s, url, model, extra)))
            if args.request_rate != float("inf"):  # Poisson arrivals
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = [r for rs in await asyncio.gather(*tasks) for r in rs]
        duration = time.perf_counter() - start
    return summarize(results, duration, model)


def percentiles(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    s = sorted(xs)

    def pct(p: float) -> float:  # linear interpolation between closest ranks
        k = (len(s) - 1) * p
        lo, hi = int(k), min(int(k) + 1, len(s) - 1)
        return s[lo] + (s[hi] - s[lo]) * (k - lo)

    return {"mean": sum(s) / len(s) * 1000, "median": pct(0.5) * 1000, "p99": pct(0.99) * 1000}


def summarize(results: list[Result], duration: float, model: str) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    output = sum(r.completion_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.completion_tokens - 1) for r in ok if r.completion_tokens > 1]
    return {
        "model": model,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "total_input_tokens": prompt,
        "total_output_tokens": output,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "input_throughput": prompt / duration if duration else 0.0,
        "output_throughput": output / duration if duration else 0.0,
        "cache_hit_rate": cached / prompt if prompt else 0.0,
        "cached_tokens": cached,
        "ttft_ms": percentiles([r.ttft for r in ok]),
        "itl_ms": percentiles([x for r in ok for x in r.itl]),
        "tpot_ms": percentiles(tpot),
        "e2e_ms": percentiles([r.e2e for r in ok]),
        # per request, in the order sent: prompt, cached and output tokens (for the floor)
        "requests": [[r.prompt_tokens, r.cached_tokens, r.completion_tokens] for r in results],
        "ttft_s": [r.ttft if r.ok else None for r in results],  # per request, in the order sent
    }


def add_floor(reports: dict[str, dict[str, Any]], machine: floor.Machine, args) -> dict[str, float]:
    """The workload's floor, on the requests of the server that reused the most (which request
    finds a prefix cached depends on the order of arrival, so one server's requests are taken
    whole), and each server's duration as a multiple of it."""
    runs = [rep["requests"] for rep in reports.values() if not rep["failed"]]
    if not runs:
        return {}
    best = max(runs, key=lambda run: sum(cached for _, cached, _ in run))
    requests = [{"prompt": p, "cached": c, "output": o} for p, c, o in best]
    shape = floor.load_shape(args.floor_model)
    f = floor.workload_floor(
        machine, shape, requests, args.max_concurrency or len(requests), args.floor_bytes_per_weight
    )
    f |= {"gemm_gflops": machine.gemm_flops / 1e9, "gemm_dtype": machine.gemm_dtype}
    f |= {"bandwidth_gb_s": machine.bandwidth / 1e9, "model": args.floor_model or "the default model"}
    f |= {"weights": shape.params}
    for rep in reports.values():
        rep["x_floor"] = rep["duration_s"] / f["floor_s"] if f["floor_s"] else 0.0
    return f


def print_floor(f: dict[str, float], reports: dict[str, dict[str, Any]]) -> None:
    print(
        f"floor of {f['model']} ({f['weights'] / 1e6:.0f}M weights; --floor-model for another): "
        f"{f['prompt_tokens_computed']} prompt tokens computed at {f['gemm_gflops']:.0f} GFLOP/s "
        f"({f['gemm_dtype']}) = {f['prefill_s']:.2f} s; {f['decode_steps']} decode steps of batch "
        f"{f['decode_batch']} x {f['decode_step_s'] * 1000:.1f} ms (weights at "
        f"{f['bandwidth_gb_s']:.1f} GB/s, or their FLOPs) = {f['decode_s']:.2f} s; "
        f"floor {f['floor_s']:.2f} s"
    )
    print("x floor: " + "  ".join(f"{n} {rep['x_floor']:.2f}x" for n, rep in reports.items()))


def print_table(reports: dict[str, dict[str, Any]]) -> None:
    names = list(reports)
    rows = [
        ("completed", "completed", "{:.0f}"),
        ("failed", "failed", "{:.0f}"),
        ("duration (s)", "duration_s", "{:.2f}"),
        ("request throughput (req/s)", "request_throughput", "{:.2f}"),
        ("input throughput (tok/s)", "input_throughput", "{:.1f}"),
        ("output throughput (tok/s)", "output_throughput", "{:.1f}"),
        ("cache hit rate", "cache_hit_rate", "{:.1%}"),
    ]
    for metric in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        for stat in ("mean", "median", "p99"):
            rows.append((f"{metric[:-3].upper()} {stat} (ms)", (metric, stat), "{:.1f}"))
    width = max(len(r[0]) for r in rows) + 2
    print("".ljust(width) + "".join(n.rjust(16) for n in names))
    for label, key, fmt in rows:
        vals = [reports[n][key[0]][key[1]] if isinstance(key, tuple) else reports[n][key] for n in names]
        print(label.ljust(width) + "".join(fmt.format(v).rjust(16) for v in vals))
    for n in names:
        for e in reports[n]["errors"]:
            print(f"[{n}] error: {e}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--base-url",
        action="append",
        required=True,
        help="server root (repeat, optionally name=url, to compare side by side)",
    )
    p.add_argument("--model", help="model name (default: the server's first)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--dataset", default="random", choices=["random", "generated-shared-prefix", "multi-turn"])
    p.add_argument("--num-prompts", type=int, default=64, help="random prompts / conversations")
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=1.0)
    p.add_argument("--gsp-num-groups", type=int, default=8)
    p.add_argument("--gsp-prompts-per-group", type=int, default=16)
    p.add_argument("--gsp-system-prompt-len", type=int, default=1000)
    p.add_argument("--gsp-question-len", type=int, default=32)
    p.add_argument("--gsp-output-len", type=int, default=64)
    p.add_argument("--multi-turn-turns", type=int, default=4)
    p.add_argument("--multi-turn-input-len", type=int, default=64)
    p.add_argument("--multi-turn-output-len", type=int, default=32)
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="conversations started per second (Poisson); inf = all at once",
    )
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send ignore_eos (an SGLang/vLLM/RadixServe extension) for exact lengths",
    )
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output-file", help="write the reports as JSON here")
    p.add_argument(
        "--floor-model", help="HF directory or GGUF of the served model (default: the default model)"
    )
    p.add_argument(
        "--floor-bytes-per-weight",
        type=float,
        default=2.0,
        help="bytes a decode step reads per weight and per KV element (2: bf16)",
    )
    p.add_argument("--no-floor", action="store_true", help="skip the machine's floor")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    args = parse_args(argv)
    convs = build(args)
    machine = None if args.no_floor else floor.measure_machine()  # before the load, on an idle host
    reports = {}
    for i, spec in enumerate(args.base_url):
        name, _, url = spec.partition("=") if "=" in spec.split("://")[0] else ("", "", spec)
        name = name or (f"server{i}" if len(args.base_url) > 1 else "server")
        reports[name] = asyncio.run(benchmark(url.rstrip("/"), convs, args))
    print_table(reports)
    bound = add_floor(reports, machine, args) if machine else {}
    if bound:
        print_floor(bound, reports)
    if args.output_file:
        with open(args.output_file, "w") as f:
            json.dump(
                {
                    "args": vars(args) | {"request_rate": str(args.request_rate)},
                    "reports": reports,
                    "floor": bound,
                },
                f,
                indent=2,
            )
    return reports


if __name__ == "__main__":
    main()
