"""Process-wide runtime settings (workers/executor/cpu_runtime.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_the_startup_heap_leaves_the_collectors_walk():
    """After freeze_startup_heap, a full collection walks none of the objects alive before it
    (in a child process: a frozen heap is never collected)."""
    code = textwrap.dedent(
        """
        import gc
        from radixserve.workers.executor.cpu_runtime import freeze_startup_heap

        kept = [[i] for i in range(100_000)]  # lists: always tracked
        walked = len(gc.get_objects())
        assert walked > 100_000
        frozen = freeze_startup_heap()
        assert frozen >= 100_000 and gc.get_freeze_count() == frozen
        later = [[j] for j in range(10)]
        assert len(gc.get_objects()) < 1_000, len(gc.get_objects())
        print("ok", walked, frozen)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("ok")
