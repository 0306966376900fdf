"""The CPU-checkable parts of the GPU benchmark and its driver script: the model's byte and FLOP
accounting, the logits check, `--help`, `--dry-run`, and the script's answer on a machine without
a GPU. The figures themselves need a GPU (load_tests/gpu_check.sh)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from load_tests import gpu_bench
from load_tests.gpu_model import LLAMA3_8B, TINY, RandomLlama, scattered_layout, step_inputs

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "load_tests" / "gpu_check.sh"


def test_llama3_8b_shape_counts():
    assert LLAMA3_8B.head_dim == 128
    assert LLAMA3_8B.params == 8_030_261_248  # Llama-3-8B's published parameter count
    embedding_row, weights = 4096 * 2, (8_030_261_248 - 128256 * 4096) * 2
    kv_per_token = 32 * 2 * 8 * 128 * 2
    assert LLAMA3_8B.decode_bytes(1, 4096) == weights + embedding_row + 4097 * kv_per_token


def test_prefill_flops_match_the_forward_matmuls():
    """Projections and LM head, counted by torch on a real forward (attention left out: the
    stand-in returns q), plus attention over 2 sequences of 5 cached and 3 new tokens."""
    model = RandomLlama(TINY, 64, "cpu", dtype=torch.float32)
    layout = scattered_layout(2, 5, 3, 64, "cpu")
    with FlopCounterMode(display=False) as counter:
        model.forward(**step_inputs(layout), attention=lambda q, layer: q)
    keys_seen = 2 * (3 * 5 + (1 + 2 + 3))
    attention = 4 * TINY.layers * TINY.heads * TINY.head_dim * keys_seen
    assert TINY.prefill_flops(2, 3, 5) == counter.get_total_flops() + attention


def test_layout_scatters_distinct_slots_and_step_inputs_address_the_new_tokens():
    layout = scattered_layout(3, 4, 2, 40, "cpu", seed=5)
    assert layout.kv_indices.shape == (3, 6) and layout.seq_lens.tolist() == [6, 6, 6]
    assert len(set(layout.kv_indices.flatten().tolist())) == 18
    inputs = step_inputs(layout)
    assert inputs["positions"].tolist() == [4, 5] * 3
    assert inputs["out_slots"].tolist() == layout.kv_indices[:, 4:].flatten().tolist()
    assert inputs["logits_rows"].tolist() == [1, 3, 5]
    with pytest.raises(ValueError, match="3 sequences of 6 tokens do not fit 17 slots"):
        scattered_layout(3, 4, 2, 17, "cpu")


def test_logits_check_fails_on_wrong_attention(monkeypatch):
    model = RandomLlama(TINY, 64, "cpu", dtype=torch.float32)
    layout = scattered_layout(1, 6, 1, 64, "cpu")
    monkeypatch.setattr(gpu_bench, "triton_attention", lambda m, lay: lambda q, layer: torch.zeros_like(q))
    with pytest.raises(AssertionError, match="logits differ from torch attention's by"):
        gpu_bench.check_logits(model, layout, 0.05)


def test_bench_without_a_gpu_says_so(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_bench.main([]) == 2
    assert "gpu_bench: no CUDA GPU visible; nothing measured" in capsys.readouterr().err


def _run(args: list[str], timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        args, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout
    )


def test_bench_help_and_dry_run(tmp_path):
    helped = _run([sys.executable, "-m", "load_tests.gpu_bench", "--help"])
    assert helped.returncode == 0 and "--dry-run" in helped.stdout and "--prefill-len" in helped.stdout
    out = tmp_path / "figures.json"
    dry = _run([sys.executable, "-m", "load_tests.gpu_bench", "--dry-run", "--json", str(out)])
    assert dry.returncode == 0, dry.stderr
    assert "decode batch 1, context 40" in dry.stdout and "prefill 1 x 24 (prefix 8)" in dry.stdout
    figures = json.loads(out.read_text())
    assert figures["shape"] == "tiny" and figures["dtype"] == "float32"
    assert figures["decode"]["bytes_per_step"] == TINY.decode_bytes(1, 40, elem=4)
    assert figures["decode"]["rel_diff"] < 1e-4 and figures["prefill"]["rel_diff"] < 1e-4
    assert figures["kernels"]["decode_GBps"] > 0 and figures["kernels"]["extend_TFLOPs"] > 0
    engine = figures["engine"]  # the engine's own model, the decode graph's buffers run eagerly here
    assert engine["backend"] == "triton" and "decode_graph_ms" not in engine
    assert engine["decode_rel_diff"] < 1e-4 and engine["prefill_rel_diff"] < 1e-4
    assert engine["graph_rel_diff"] == 0 and engine["decode_GBps"] > 0 and engine["prefill_TFLOPs"] > 0
    assert "engine (triton attention) decode batch 1" in dry.stdout


def test_check_script_without_a_gpu_checks_nothing_and_says_so():
    assert _run(["bash", "-n", str(SCRIPT)]).returncode == 0
    proc = _run(["bash", str(SCRIPT)], NVIDIA_SMI="/nonexistent/nvidia-smi")
    assert proc.returncode == 0
    assert proc.stdout.splitlines() == [
        "gpu_check: no NVIDIA GPU visible (/nonexistent/nvidia-smi missing or lists no GPU): nothing checked.",
        "gpu_check: 'bash load_tests/gpu_check.sh --dry-run' runs the same steps on CPU.",
    ]
    bad = _run(["bash", str(SCRIPT), "--bogus"])
    assert bad.returncode == 1 and "unknown argument '--bogus'" in bad.stderr


@pytest.mark.slow
def test_check_script_dry_run(tmp_path):
    """Every step of the script on CPU; of the test files, one test each (the suite runs them)."""
    one_each = "test_splits_are_powers_of_two_bounded_by_length or test_graph_buckets"
    proc = _run(
        ["bash", str(SCRIPT), "--dry-run"], timeout=600, PYTHON=sys.executable, GPU_CHECK_TESTS=one_each
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "passed" in proc.stdout and "gpu_check: done" in proc.stdout
    assert "logits vs torch attention (rel. L2)" in proc.stdout
