"""Router benchmark: cache_aware vs round_robin on the same workload, in one run.

    python -m load_tests.bench_router                       # defaults below, ~3-4 minutes on 2 cores
    python -m load_tests.bench_router --gsp-num-groups 32 --max-total-tokens 8192

Starts one local Ray instance and one Serve application per policy, each with `--dp` engine
replicas (one CPU, `--num-threads` torch threads and a `--max-total-tokens` KV pool each), then
sends every application the same generated-shared-prefix workload (load_tests/bench_datasets.py)
through bench_serving's client, one application at a time so they do not share the CPUs. The
workload has more groups than one replica's pool can hold: a router that spreads a group over
the replicas makes each replica cache every group, and they evict each other.

Reports per policy: cached prompt tokens (from `usage`), throughput, TTFT, the router's own
counters and the requests / cached tokens per replica; then the ratios cache_aware / round_robin.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import time
from typing import Any

import httpx

from load_tests.bench_datasets import shared_prefix_dataset
from load_tests.bench_serving import benchmark, print_table
from radixserve.router.routing.policy import PolicyConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--policies",
        default="cache_aware,round_robin",
        help="comma-separated router policies, compared in this order",
    )
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--max-total-tokens", type=int, default=4096, help="KV pool per replica")
    p.add_argument("--num-threads", type=int, default=1, help="torch threads per replica")
    p.add_argument("--max-running-requests", type=int, default=16)
    p.add_argument("--radix-eviction-policy", default="lru", choices=("lru", "lfu"))
    p.add_argument("--cache-threshold", type=float, default=PolicyConfig.cache_threshold)
    p.add_argument("--min-match-tokens", type=int, default=PolicyConfig.min_match_tokens)
    p.add_argument("--load-cost-tokens", type=int, default=PolicyConfig.load_cost_tokens)
    p.add_argument("--balance-abs-threshold", type=int, default=PolicyConfig.balance_abs_threshold)
    p.add_argument("--balance-rel-threshold", type=float, default=PolicyConfig.balance_rel_threshold)
    p.add_argument("--gsp-num-groups", type=int, default=12)
    p.add_argument("--gsp-prompts-per-group", type=int, default=8)
    p.add_argument("--gsp-system-prompt-len", type=int, default=600)
    p.add_argument("--gsp-question-len", type=int, default=32)
    p.add_argument("--gsp-output-len", type=int, default=16)
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="repeat the comparison, alternating which policy goes first (other "
        "processes' CPU load drifts); figures are combined over rounds",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--output-file", help="write the reports as JSON here")
    return p.parse_args(argv)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deploy(policy: str, args: argparse.Namespace) -> None:
    from ray import serve

    from radixserve.cluster.app import build_app

    serve.run(
        build_app(
            {
                "dp": args.dp,
                "router_policy": policy,
                "replica_num_cpus": 1,
                "num_threads": args.num_threads,
                "max_total_tokens": args.max_total_tokens,
                "max_running_requests": args.max_running_requests,
                "radix_eviction_policy": args.radix_eviction_policy,
                "cache_threshold": args.cache_threshold,
                "min_match_tokens": args.min_match_tokens,
                "load_cost_tokens": args.load_cost_tokens,
                "balance_abs_threshold": args.balance_abs_threshold,
                "balance_rel_threshold": args.balance_rel_threshold,
            }
        ),
        name=f"bench-{policy}",
        route_prefix="/",
    )


def client_args(args: argparse.Namespace) -> argparse.Namespace:
    """What bench_serving.benchmark reads."""
    return argparse.Namespace(
        api_key=None,
        model=None,
        timeout=args.timeout,
        seed=args.seed,
        max_concurrency=args.max_concurrency,
        request_rate=args.request_rate,
        ignore_eos=True,
    )


def server_side(url: str) -> dict[str, Any]:
    info = httpx.get(url + "/get_server_info", timeout=60).json()
    replicas = {
        r["replica_id"]: {
            "requests": r["num_requests_total"],
            "cached_tokens": r["cached_tokens_total"],
            "prompt_tokens": r["prompt_tokens_total"],
        }
        for r in info["replicas"]
    }
    router = {
        k: info["router"][k]
        for k in ("policy", "requests_total", "prefix_hits", "prefix_misses", "imbalance_fallbacks")
    }
    return {"replicas": replicas, "router": router}


def run_policy(policy: str, url: str, args: argparse.Namespace) -> dict[str, Any]:
    from ray import serve

    t0 = time.perf_counter()
    deploy(policy, args)
    print(
        f"[{policy}] deployed in {time.perf_counter() - t0:.0f}s; running "
        f"{args.gsp_num_groups * args.gsp_prompts_per_group} requests",
        flush=True,
    )
    convs = shared_prefix_dataset(
        args.gsp_num_groups,
        args.gsp_prompts_per_group,
        args.gsp_system_prompt_len,
        args.gsp_question_len,
        args.gsp_output_len,
        args.seed,
    )
    load_before = os.getloadavg()[0]
    report = asyncio.run(benchmark(url, convs, client_args(args)))
    report["cached_tokens"] = round(report["cache_hit_rate"] * report["total_input_tokens"])
    report["loadavg_1m"] = {"before": load_before, "after": os.getloadavg()[0]}
    report["server"] = server_side(url)
    serve.delete(f"bench-{policy}")
    return report


def combine(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One policy's rounds as one report: totals summed, rates over the summed duration, latency
    percentiles averaged over rounds."""
    if len(rounds) == 1:
        return rounds[0]
    total = {
        k: sum(r[k] for r in rounds)
        for k in (
            "completed",
            "failed",
            "duration_s",
            "total_input_tokens",
            "total_output_tokens",
            "cached_tokens",
        )
    }
    out = {**rounds[0], **total, "errors": sorted({e for r in rounds for e in r["errors"]})[:5]}
    out["request_throughput"] = total["completed"] / total["duration_s"]
    out["input_throughput"] = total["total_input_tokens"] / total["duration_s"]
    out["output_throughput"] = total["total_output_tokens"] / total["duration_s"]
    out["cache_hit_rate"] = total["cached_tokens"] / max(total["total_input_tokens"], 1)
    for metric in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        out[metric] = {s: sum(r[metric][s] for r in rounds) / len(rounds) for s in ("mean", "median", "p99")}
    out["rounds"] = rounds
    return out


def ratios(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    def div(x: float, y: float) -> float:
        return x / y if y else float("inf")

    return {
        "cached_tokens": div(a["cached_tokens"], b["cached_tokens"]),
        "request_throughput": div(a["request_throughput"], b["request_throughput"]),
        "output_throughput": div(a["output_throughput"], b["output_throughput"]),
        "ttft_p50": div(a["ttft_ms"]["median"], b["ttft_ms"]["median"]),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import ray
    from ray import serve

    args = parse_args(argv)
    policies = args.policies.split(",")
    ray.init(num_cpus=args.dp, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
    try:
        for k in range(args.rounds):
            for policy in policies if k % 2 == 0 else policies[::-1]:
                runs[policy].append(run_policy(policy, url, args))
    finally:
        serve.shutdown()
        ray.shutdown()
    reports = {p: combine(r) for p, r in runs.items()}
    print_table(reports)
    for name, rs in runs.items():
        for r in rs:
            print(
                f"[{name}] cached tokens {r['cached_tokens']}, router {r['server']['router']}, "
                f"replicas {r['server']['replicas']}, loadavg {r['loadavg_1m']}"
            )
    out: dict[str, Any] = {"reports": reports}
    if len(policies) >= 2:
        out["ratios"] = ratios(reports[policies[0]], reports[policies[1]])
        print(
            f"{policies[0]} / {policies[1]}: " + ", ".join(f"{k} {v:.2f}x" for k, v in out["ratios"].items())
        )
    if args.output_file:
        with open(args.output_file, "w") as f:
            json.dump({"args": vars(args) | {"request_rate": str(args.request_rate)}, **out}, f, indent=2)
    return out


if __name__ == "__main__":
    main()
