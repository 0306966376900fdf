"""PD disaggregation against unified serving at equal CPUs, on the workload PD is for: long
prompts keep arriving while other requests decode long outputs.

    python -m load_tests.bench_pd                     # PD 1 prefill + 1 decode vs unified dp=2
    python -m load_tests.bench_pd --modes pd --long-prompt-tokens 3000
    python -m load_tests.bench_pd --pd-local-prefill-tokens 0 128   # PD twice: all, or short local

Each mode is deployed on a local Ray instance (each engine replica with `--cpus-per-replica`
CPUs and as many torch threads), then driven by the same client: `--decoders` streams of short
prompts with `--decode-tokens` outputs run back to back, while a long prompt (`--long-prompt-tokens`
tokens, `--long-output-tokens` out) arrives every `--long-interval-s`. Reported side by side: ITL
p50 / p99 of the decoding streams (what a long prefill stalls), TTFT p50 / p99 of the long
prompts and of the decoding streams, and output throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from typing import Any

import aiohttp

from load_tests.bench_router import free_port
from load_tests.bench_serving import Result, send

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho".split()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", nargs="+", default=["unified", "pd"], choices=["unified", "pd"])
    p.add_argument("--cpus-per-replica", type=int, default=1)
    p.add_argument("--kv-transfer", default="gloo")
    p.add_argument("--decoders", type=int, default=4, help="concurrent decoding streams")
    p.add_argument("--decode-tokens", type=int, default=96)
    p.add_argument("--long-prompt-tokens", type=int, default=1000)
    p.add_argument("--long-output-tokens", type=int, default=8)
    p.add_argument("--long-interval-s", type=float, default=3.0)
    p.add_argument("--duration-s", type=float, default=60.0)
    p.add_argument("--max-total-tokens", type=int, default=32768)
    p.add_argument("--chunked-prefill-size", type=int, default=2048, help="both modes (the server default)")
    p.add_argument(
        "--pd-local-prefill-tokens",
        type=int,
        nargs="+",
        default=[0],
        help="PD runs, one per value: prompts this short are prefilled on their decode replica",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the report as JSON here")
    return p.parse_args(argv)


def server_args(mode: str, args: argparse.Namespace, local_prefill: int = 0) -> dict[str, Any]:
    common = {
        "num_threads": args.cpus_per_replica,
        "max_total_tokens": args.max_total_tokens,
        "chunked_prefill_size": args.chunked_prefill_size,
        "router_policy": "round_robin",
    }
    if mode == "pd":
        return {
            **common,
            "pd": True,
            "prefill_num_cpus": args.cpus_per_replica,
            "decode_num_cpus": args.cpus_per_replica,
            "kv_transfer": args.kv_transfer,
            "pd_local_prefill_tokens": local_prefill,
        }
    return {**common, "dp": 2, "replica_num_cpus": args.cpus_per_replica}


def percentiles(xs: list[float]) -> dict[str, float]:
    """ms: median, p99, p99.9 and max (a long prefill stalls a few decode steps in a thousand:
    the tail past p99 is where it shows)."""
    if not xs:
        return {"median": 0.0, "p99": 0.0, "p999": 0.0, "max": 0.0}
    s = sorted(xs)

    def pct(p: float) -> float:
        k = (len(s) - 1) * p
        lo, hi = int(k), min(int(k) + 1, len(s) - 1)
        return (s[lo] + (s[hi] - s[lo]) * (k - lo)) * 1000

    return {"median": pct(0.5), "p99": pct(0.99), "p999": pct(0.999), "max": s[-1] * 1000}


def text_of(tokens: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(tokens))  # about one token per word


async def workload(url: str, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as s:
        model = (await (await s.get(url + "/v1/models")).json())["data"][0]["id"]
        extra = {"ignore_eos": True}
        end = time.perf_counter() + args.duration_s
        decode_results: list[Result] = []
        long_results: list[Result] = []

        async def decoder(k: int) -> None:
            n = 0
            while time.perf_counter() < end:
                msg = [{"role": "user", "content": f"Story {k}.{n}: " + text_of(16, rng)}]
                decode_results.append(await send(s, url, model, msg, args.decode_tokens, extra))
                n += 1

        async def long_prompts() -> None:
            tasks = []
            while time.perf_counter() < end:
                msg = [{"role": "user", "content": text_of(args.long_prompt_tokens, rng)}]
                tasks.append(asyncio.ensure_future(send(s, url, model, msg, args.long_output_tokens, extra)))
                await asyncio.sleep(args.long_interval_s)
            long_results.extend(await asyncio.gather(*tasks))

        start = time.perf_counter()
        await asyncio.gather(long_prompts(), *(decoder(k) for k in range(args.decoders)))
        duration = time.perf_counter() - start
    ok_d = [r for r in decode_results if r.ok]
    ok_l = [r for r in long_results if r.ok]
    output = sum(r.completion_tokens for r in ok_d + ok_l)
    return {
        "completed": len(ok_d) + len(ok_l),
        "failed": len(decode_results) + len(long_results) - len(ok_d) - len(ok_l),
        "errors": sorted({r.error for r in decode_results + long_results if not r.ok})[:3],
        "duration_s": round(duration, 1),
        "output_throughput": round(output / duration, 1),
        "decode_itl_ms": percentiles([x for r in ok_d for x in r.itl]),
        # Past the second token: in PD the first gap is the hand-off (transfer, admission).
        "decode_itl_after_second_ms": percentiles([x for r in ok_d for x in r.itl[1:]]),
        "decode_ttft_ms": percentiles([r.ttft for r in ok_d]),
        "long_ttft_ms": percentiles([r.ttft for r in ok_l]),
        "long_prompts": len(ok_l),
        "long_prompt_tokens_avg": round(sum(r.prompt_tokens for r in ok_l) / max(len(ok_l), 1)),
    }


def run_mode(mode: str, args: argparse.Namespace, local_prefill: int = 0) -> dict[str, Any]:
    import ray
    from ray import serve

    from radixserve.cluster.app import build_app

    port = free_port()
    ray.init(num_cpus=2 * args.cpus_per_replica, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(server_args(mode, args, local_prefill)), name=f"bench-{mode}", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        asyncio.run(warm_up(url))
        return asyncio.run(workload(url, args))
    finally:
        serve.shutdown()
        ray.shutdown()


async def warm_up(url: str) -> None:
    async with aiohttp.ClientSession() as s:
        for _ in range(2):
            body = {"text": "warm up", "sampling_params": {"max_new_tokens": 4}}
            async with s.post(url + "/generate", json=body) as r:
                await r.read()


def print_table(report: dict[str, dict[str, Any]]) -> None:
    rows = [
        ("decode ITL p50 (ms)", lambda r: r["decode_itl_ms"]["median"]),
        ("decode ITL p99 (ms)", lambda r: r["decode_itl_ms"]["p99"]),
        ("decode ITL p99.9 (ms)", lambda r: r["decode_itl_ms"]["p999"]),
        ("decode ITL max (ms)", lambda r: r["decode_itl_ms"]["max"]),
        ("  past 2nd token p99", lambda r: r["decode_itl_after_second_ms"]["p99"]),
        ("  past 2nd token p99.9", lambda r: r["decode_itl_after_second_ms"]["p999"]),
        ("long TTFT p50 (ms)", lambda r: r["long_ttft_ms"]["median"]),
        ("long TTFT p99 (ms)", lambda r: r["long_ttft_ms"]["p99"]),
        ("decode TTFT p50 (ms)", lambda r: r["decode_ttft_ms"]["median"]),
        ("decode TTFT p99 (ms)", lambda r: r["decode_ttft_ms"]["p99"]),
        ("output tok/s", lambda r: r["output_throughput"]),
        ("completed / failed", lambda r: f"{r['completed']} / {r['failed']}"),
    ]
    names = list(report)
    print(f"{'':24}" + "".join(f"{n:>14}" for n in names))
    for label, get in rows:
        cells = []
        for n in names:
            v = get(report[n])
            cells.append(f"{v:>14.1f}" if isinstance(v, float) else f"{v!s:>14}")
        print(f"{label:24}" + "".join(cells))


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    args = parse_args(argv)
    report: dict[str, dict[str, Any]] = {}
    for mode in args.modes:
        if mode != "pd":
            report[mode] = run_mode(mode, args)
            continue
        for local in args.pd_local_prefill_tokens:
            report["pd" if local == 0 else f"pd,local<={local}"] = run_mode(mode, args, local)
    print_table(report)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
