"""The engine loop's own Python time per decode step, at fixed decode batch sizes.

For each batch size B: B prompts of --prompt-tokens, --output-tokens each (greedy, ignore_eos),
run whole on one engine with the overlap mode off (so that host time is not hidden behind the
forward), then the decode steps that ran exactly B sequences are read from the engine's step
timings: `schedule` (step-boundary housekeeping, scheduling, building tensors, token updates) and
`text` (detokenization, stop strings, chunks), in ms per step, medians over --repeats runs. The
forward and sampling are reported beside them for scale.

    python -m load_tests.bench_step_loop                      # batch 8 and 64, ~2 minutes
    python -m load_tests.bench_step_loop --batch 8 64 --repeats 5 --json results/step_loop.json

To compare two checkouts side by side, run this module from each in turn (alternating), each
with its own package on PYTHONPATH; the figures of one run only are comparable.
"""

from __future__ import annotations

import argparse
import json
import statistics
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--output-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from radixserve.workers import Engine

    engine = Engine(args.model_path, max_running_requests=max(args.batch), enable_overlap=False)
    results: dict[str, Any] = {}
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
        engine.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
