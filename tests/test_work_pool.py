"""The kernels' own thread pool (kernels/csrc/work_pool.h): the same results on any number of
threads and from several calling threads at once, kernels in a forked child, idle workers that
sleep, and OpenMP's spin-wait set short before torch loads."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import torch

from radixserve.kernels import cpu_ops
from radixserve.kernels.quant_ops import quantize_int8

native = cpu_ops.native_ops()
pytestmark = pytest.mark.skipif(native is None, reason="C++ extension not built (no compiler)")


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _inputs(seed: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(300, 576, generator=g).to(torch.bfloat16),
        "w": torch.randn(576, generator=g).to(torch.bfloat16),
        "k_buf": torch.randn(4096, 3, 64, generator=g).to(torch.bfloat16),
        "q": torch.randn(24, 9, 64, generator=g).to(torch.bfloat16),
        "kv_indices": torch.randint(0, 4096, (24, 700), generator=g),
        "seq_lens": torch.randint(1, 701, (24,), generator=g),
        "wp": cpu_ops.pack_linear_weight(torch.randn(1536, 576, generator=g).to(torch.bfloat16))
        if cpu_ops.gemm_available(torch.bfloat16)
        else None,
        "qt": quantize_int8(torch.randn(1536, 576, generator=g)),
    }


def _kernels(seed: int, inputs: dict[str, object] | None = None) -> list[torch.Tensor]:
    """A few kernels over inputs large enough to be split into many chunks (and nothing else:
    no torch op that would run on OpenMP)."""
    a: dict[str, Any] = dict(inputs or _inputs(seed))
    x = a["x"]
    out = [native.rms_norm(x, a["w"], 1e-5), native.silu_mul(x)]
    out.append(native.decode_attention(a["q"], a["k_buf"], a["k_buf"], a["kv_indices"], a["seq_lens"], 0.125))
    if a["wp"] is not None:
        out.append(native.packed_linear(x[:8], a["wp"], 1536, None))
    xf = x[:5].float()
    out += [a["qt"].linear(xf[:1]), a["qt"].linear(xf)]  # the one-row and the tiled kernel
    return out


def _bits(t: torch.Tensor) -> bytes:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32).numpy().tobytes()


def test_results_do_not_depend_on_the_thread_count(threads):
    """Every chunk's outputs are computed by one thread with the same code, whichever claims it:
    one thread, two, and more threads than this machine has cores agree bit for bit."""
    threads(1)
    ref = _kernels(0)
    for n in (2, 5):
        threads(n)
        for _ in range(3):
            for a, b in zip(ref, _kernels(0), strict=True):
                assert torch.equal(a, b)


def test_callers_on_several_threads_share_the_pool(threads):
    """Two engine threads in one process (two engines, or a TP leader beside its own work) run
    their jobs through the one pool in turn, each getting its own results."""
    threads(2)
    refs = {seed: _kernels(seed) for seed in (1, 2)}
    errors: list[str] = []

    def run(seed: int) -> None:
        for _ in range(20):
            for a, b in zip(refs[seed], _kernels(seed), strict=True):
                if not torch.equal(a, b):
                    errors.append(f"seed {seed} differs")
                    return

    workers = [threading.Thread(target=run, args=(s,)) for s in (1, 2, 1)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    assert errors == []


def test_a_forked_child_computes_with_a_pool_of_its_own(threads):
    threads(2)
    inputs = _inputs(3)
    ref = _kernels(3, inputs)  # the parent's pool is started
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: none of the parent's workers exist here
        ok = False
        try:  # compared through numpy: torch's own OpenMP ops hang in a child forked from a team
            ok = [_bits(t) for t in ref] == [_bits(t) for t in _kernels(3, inputs)]
        finally:
            os.write(w, b"1" if ok else b"0")
            os._exit(0)
    os.close(w)
    try:
        got = os.read(r, 1)
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    assert got == b"1"


def test_idle_workers_sleep(threads):
    """After a job, workers spin for ~50 us and then sleep: an idle engine takes no CPU."""
    threads(2)
    _kernels(4)
    time.sleep(0.05)
    before = time.process_time()
    time.sleep(0.5)
    assert time.process_time() - before < 0.1


def test_openmp_spin_wait_is_short_unless_the_user_set_it():
    """The packages that import torch set GOMP_SPINCOUNT before libgomp reads it; a user's own
    value stays."""
    code = "import radixserve.workers, os; print(os.environ['GOMP_SPINCOUNT'])"
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1000"
    code = "import radixserve.cluster, os; print(os.environ['GOMP_SPINCOUNT'])"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, "GOMP_SPINCOUNT": "7"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "7"


@pytest.mark.parametrize(
    "code,given,unset",
    [
        ("import torch, radixserve.kernels as k", {}, True),  # libgomp read its default first
        ("import radixserve.kernels as k, torch", {}, False),
        ("import torch, radixserve.kernels as k", {"GOMP_SPINCOUNT": "7"}, False),  # the user's own
    ],
)
def test_a_spin_count_set_after_openmp_loaded_is_reported(code, given, unset):
    """OPENMP_SPIN_UNSET (the CPU engine's warning) says when the short spin came too late."""
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run(
        [sys.executable, "-c", code + "; print(k.OPENMP_SPIN_UNSET)"],
        env={**env, **given},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == str(unset)
