"""StepStats is written by the engine thread and read by others (replica stats, metrics)."""

from __future__ import annotations

import sys
import threading

from radixserve.workers.engine.step_stats import StepStats


def test_summary_while_the_engine_records():
    stats = StepStats()
    for _ in range(600):
        stats.record("decode", 4, 4, 0.001, 0.01, 0.001)
    stop = threading.Event()

    def engine_thread():
        while not stop.is_set():
            stats.record("decode", 4, 4, 0.001, 0.01, 0.001)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible, mid-iteration included
    writer = threading.Thread(target=engine_thread)
    writer.start()
    try:
        summaries = [stats.summary() for _ in range(2000)]  # iterating a deque being appended to raises
    finally:
        stop.set()
        writer.join()
        sys.setswitchinterval(interval)
    assert all(s["decode_batch_size_avg"] == 4 for s in summaries)
