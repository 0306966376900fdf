"""The engine loop's own Python time per decode step, at fixed decode batch sizes.

For each batch size B: B prompts of --prompt-tokens, --output-tokens each (greedy, ignore_eos),
run whole on one engine with the overlap mode off (so that host time is not hidden behind the
forward), then the decode steps that ran exactly B sequences are read from the engine's step
timings: `schedule` (step-boundary housekeeping, scheduling, building tensors, token updates) and
`text` (detokenization, stop strings, chunks), in ms per step, medians over --repeats runs. The
forward and sampling are reported beside them for scale.

    python -m load_tests.bench_step_loop                      # batch 8 and 64, ~2 minutes
    python -m load_tests.bench_step_loop --batch 8 64 --repeats 5 --json results/step_loop.json

`--contend DUTY` runs the same beside two processes that each keep a core busy for DUTY of every
10 ms (as a server's proxy, ingress and load generator do), at nice `--contend-nice`: what other
processes' priority does to a forward whose threads meet at barriers (router/frontend/cpu_priority.py).

    python -m load_tests.bench_step_loop --batch 8 --prompt-tokens 250 --contend 0.2 --contend-nice 0

To compare two checkouts side by side, run this module from each in turn (alternating), each
with its own package on PYTHONPATH; the figures of one run only are comparable.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from typing import Any

from load_tests.bench_offline import random_workload


def step_times(engine: Any, batch: int) -> dict[str, float]:
    """Median ms per decode step of exactly `batch` sequences, over the engine's recent steps."""
    rows = [r for r in list(engine.core.timing.recent) if r[0] == "decode" and r[1] == batch]
    if not rows:
        raise RuntimeError(f"no decode step of batch {batch} was recorded")
    med = lambda i: round(1000 * statistics.median(r[i] for r in rows), 3)
    return {
        "steps": len(rows),
        "schedule_ms": med(3),
        "text_ms": med(6),
        "forward_ms": med(4),
        "sample_ms": med(5),
    }


# A busy loop for DUTY of every 10 ms at nice NICE (argv 1 and 2), until killed.
_CONTENDER = """
import os, sys, time
duty, nice = float(sys.argv[1]), int(sys.argv[2])
os.nice(nice)
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < duty * 0.01:
        pass
    time.sleep(0.01 * (1 - duty))
"""


def start_contenders(duty: float, nice: int, count: int = 2) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", _CONTENDER, str(duty), str(nice)]) for _ in range(count)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--output-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--contend", type=float, default=0.0, help="contenders' busy share of each 10 ms")
    ap.add_argument("--contend-nice", type=int, default=0)
    args = ap.parse_args(argv)
    if not 0 <= args.contend < 1:
        ap.error("--contend is a share in [0, 1)")

    from radixserve.workers import Engine

    engine = Engine(args.model_path, max_running_requests=max(args.batch), enable_overlap=False)
    results: dict[str, Any] = {}
    contenders = start_contenders(args.contend, args.contend_nice) if args.contend else []
    try:
        for batch in args.batch:
            prompts = random_workload(engine.tokenizer, batch, args.prompt_tokens, seed=batch)
            params = {"max_new_tokens": args.output_tokens, "temperature": 0, "ignore_eos": True}
            engine.generate(input_ids=prompts[:2], sampling_params={**params, "max_new_tokens": 4})
            runs = []
            for _ in range(args.repeats):
                engine.flush_cache()
                engine.core.timing.recent.clear()
                engine.generate(input_ids=prompts, sampling_params=params)
                runs.append(step_times(engine, batch))
            row = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            row["host_ms"] = round(row["schedule_ms"] + row["text_ms"], 3)
            results[f"b{batch}"] = row
            print(
                f"batch {batch:3d}: host {row['host_ms']:.3f} ms/step (schedule {row['schedule_ms']:.3f}, "
                f"text {row['text_ms']:.3f}); forward {row['forward_ms']:.3f}, sample {row['sample_ms']:.3f}",
                flush=True,
            )
    finally:
        for proc in contenders:
            proc.kill()
            proc.wait()
        engine.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
