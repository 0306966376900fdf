"""The CPU-checkable parts of the GPU benchmark and its driver script: the model's byte and FLOP
accounting, the logits check, `--help`, `--dry-run`, and the script's answer on a machine without
a GPU. The figures themselves need a GPU (load_tests/gpu_check.sh)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from load_tests import gpu_bench
from load_tests.gpu_model import LLAMA3_8B, TINY, RandomLlama, scattered_layout, step_inputs
from radixserve.kernels import cpu_ops

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
    assert figures["headline"] == gpu_bench.headline(figures)
    assert figures["headline"]["cuda_graph_decode_speedup"] is None


def test_headline_takes_the_spec_bandwidth_where_known_and_names_each_basis():
    peaks = {"copy_GBps": 4000.0, "spec_GBps": 4800.0, "matmul_TFLOPs": 800.0}
    engine = {"decode_GBps": 2400.0, "prefill_TFLOPs": 400.0, "decode_eager_ms": 9.0, "decode_graph_ms": 6.0}
    figures = {"dtype": "bfloat16", "peaks": peaks, "engine": engine}
    assert gpu_bench.headline(figures) == {
        "decode_hbm_share_batch1": 0.5,
        "decode_hbm_basis": "spec-sheet bandwidth",
        "prefill_mfu": 0.5,
        "prefill_mfu_basis": "measured bfloat16 matmul",
        "cuda_graph_decode_speedup": 1.5,
    }
    del peaks["spec_GBps"], engine["decode_graph_ms"]
    assert gpu_bench.headline(figures)["decode_hbm_share_batch1"] == 0.6
    assert gpu_bench.headline(figures)["decode_hbm_basis"] == "measured copy bandwidth"
    assert gpu_bench.headline(figures)["cuda_graph_decode_speedup"] is None


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


def test_check_script_limits_add_up_to_ten_minutes():
    """5 minutes to set up a Python, 5 for the checks (each with the seconds it has to stop after
    its limit); the header states each check's limit."""
    text = SCRIPT.read_text()
    setup, grace = (int(re.search(rf"^{name}=(\d+)", text, re.M).group(1)) for name in ("SETUP_S", "GRACE_S"))
    limits = dict(re.findall(r'^check "?([a-z ]+?)"? (\d+) ', text, re.M))
    assert setup == 300 and sum(int(limit) + grace for limit in limits.values()) <= 300
    assert set(limits) == {"triton", "device path", "bench", "kv nccl"}
    for name, limit in limits.items():
        assert re.search(rf"^#   {name} +{limit}  ", text, re.M), name


def test_check_script_names_a_driver_too_old_for_pypi_torch_in_one_line(tmp_path):
    """No Python here sees a GPU, so the script would make build/gpu-venv: it stops before that."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        '#!/bin/sh\ncase "$1" in -L) echo "GPU 0: NVIDIA H200 (UUID: GPU-0)" ;; *) echo 550.54.15 ;; esac\n'
    )
    smi.chmod(0o755)
    env = {"NVIDIA_SMI": str(smi), "PYTHON": "/nonexistent/python", "PATH": "/usr/bin:/bin"}
    proc = _run(["bash", str(SCRIPT)], **env)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        "gpu_check: NVIDIA driver 550.54.15 is older than 580.65.06, which PyPI's torch 2.13.0 (CUDA 13.0)"
        " needs: update the driver, or set PYTHON to a Python whose torch sees this GPU"
    ]
    assert "setting up build/gpu-venv" not in proc.stdout


@pytest.mark.slow
def test_check_script_dry_run(tmp_path):
    """Every step of the script on CPU, "auto" resolved as on a one-GPU host; of the test files,
    a few tests (the suite runs them all): one builds its reference engines on the cpu backend
    (left at "auto" they would ask for the GPU), one needs two GPUs and skips. The script loads
    the CPU kernels from the suite's own extension cache (same Python, same torch, and the same
    sources though it reaches them through build/lint's links), not from a fresh folder of its own:
    on a clean clone that second build took a minute of the suite."""
    tests = [
        "test_splits_are_powers_of_two_bounded_by_length",
        "test_torch_backend_equals_the_cpu_backend",
        "test_auto_is_the_gpu_where_torch_sees_one",
        "test_cuda_tp2_equals_tp1",
    ]
    proc = _run(
        ["bash", str(SCRIPT), "--dry-run"],
        timeout=600,
        PYTHON=sys.executable,
        GPU_CHECK_TESTS=" or ".join(tests),
        GPU_CHECK_RESULTS=str(tmp_path),
        TORCH_EXTENSIONS_DIR=str(cpu_ops.extensions_dir()),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The kernels' build still names the sources by their real path, as this suite's processes do.
    ninja = (Path(cpu_ops.native_ops().__file__).parent / "build.ninja").read_text()
    assert f"compile {cpu_ops._SOURCE}" in ninja and "build/lint" not in ninja
    out = proc.stdout
    assert "needs 2 CUDA GPUs; torch.cuda.device_count() is 1" in out
    assert re.search(r"^1 passed, \d+ deselected", out, re.M)  # the triton tests
    assert re.search(r"^2 passed, 1 skipped, \d+ deselected", out, re.M)  # the device path
    assert "logits vs torch attention (rel. L2)" in out
    summary = out[out.index("gpu_check: summary (dry run") :].splitlines()
    assert [line.split()[:2] for line in summary[2:7]] == [
        ["setup", "passed"],
        ["triton", "passed"],
        ["device", "path"],
        ["bench", "passed"],
        ["kv", "nccl"],
    ]
    assert summary[-2:] == [
        "gpu_check: 0 of 5 checks failed",
        f"gpu_check: written to {tmp_path / 'gpu_check.json'}",
    ]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    statuses = {c["name"]: c["status"] for c in result["checks"]}
    assert result["ok"] and statuses == {
        "setup": "passed",
        "triton": "passed",
        "device path": "passed",
        "bench": "passed",
        "kv nccl": "skipped",
    }
    figures = result["figures"]
    assert 0 < figures["decode_hbm_share_batch1"] < 1 and 0 < figures["prefill_mfu"] < 1
    assert figures["cuda_graph_decode_speedup"] is None  # no CUDA graphs on CPU
    assert figures["nccl_kv_transfer_GBps"] is None
    assert figures["nccl_kv_transfer"] == "skipped: no CUDA GPU visible (the nccl transport moves GPU pools)"
    assert result["host"] == {
        "dry_run": True,
        "nvidia_driver": None,
        "gpus": 0,
        "python": result["checks"][0]["note"],
        "device": "cpu",
    }


def test_check_script_summary_of_a_gpu_run(tmp_path):
    """The script's summary over a GPU run's files (here made up): the figures with their bases,
    the NCCL figure of the largest transfer in one message, a failed check named and exit 1."""
    summary = re.search(r"<<'PYEOF'\n(.*?)\nPYEOF\n", SCRIPT.read_text(), re.S).group(1)
    (tmp_path / "summary.py").write_text(summary)
    checks = [("setup", "passed", "3", "py"), ("triton", "passed", "40", ""), ("kv nccl", "passed", "20", "")]
    checks.insert(2, ("device path", "failed", "95", "timed out after 95 s"))
    (tmp_path / "checks.tsv").write_text("".join("\t".join(c) + "\n" for c in checks))
    headline = {
        "decode_hbm_share_batch1": 0.61,
        "decode_hbm_basis": "spec-sheet bandwidth",
        "prefill_mfu": 0.55,
        "prefill_mfu_basis": "measured bfloat16 matmul",
        "cuda_graph_decode_speedup": 1.8,
    }
    bench = {"device": "cuda", "peaks": {"device": "NVIDIA H200"}, "headline": headline}
    (tmp_path / "gpu_bench.json").write_text(json.dumps(bench))
    rows = [(1024, "whole", 5.0), (4096, "layers", 9.0), (4096, "whole", 12.5)]
    kv = {"rows": [{"tokens": n, "mode": m, "engine": {"best_gbps": g}} for n, m, g in rows], "skipped": {}}
    (tmp_path / "kv_nccl.json").write_text(json.dumps(kv))
    args = [sys.executable, str(tmp_path / "summary.py"), str(tmp_path / "checks.tsv"), str(tmp_path)]
    proc = _run([*args, "0", "580.95.05", "1"])
    assert proc.returncode == 1, proc.stderr
    lines = proc.stdout.splitlines()
    assert "  device path  failed     95  timed out after 95 s" in lines
    assert lines[-7:-2] == [
        "  figures (the engine's model)",
        "  decode HBM share, batch 1    61.0% of spec-sheet bandwidth",
        "  prefill MFU                  55.0% of measured bfloat16 matmul",
        "  CUDA-graph decode speed-up   1.80x",
        "  NCCL KV transfer             12.5 GB/s (4096 tokens)",
    ]
    assert lines[-2] == "gpu_check: 1 of 4 checks failed (device path)"
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert not result["ok"] and result["figures"]["nccl_kv_transfer_GBps"] == 12.5
    assert result["host"] == {
        "dry_run": False,
        "nvidia_driver": "580.95.05",
        "gpus": 1,
        "python": "py",
        "device": "NVIDIA H200",
    }
    refused = "two processes on one GPU: ncclInvalidUsage: Duplicate GPU detected"
    (tmp_path / "kv_nccl.json").write_text(json.dumps({"rows": [], "skipped": {"nccl": refused}}))
    lines = _run([*args, "0", "580.95.05", "1"]).stdout.splitlines()
    assert f"  kv nccl      skipped    20  {refused}" in lines
    assert f"  NCCL KV transfer             skipped: {refused}" in lines


def test_package_links_follow_pyproject(tmp_path):
    """build/lint (mypy, import-linter, gpu_check.sh) links every package that pyproject.toml maps to
    a folder, replaces a stale link, and leaves correct ones as they are."""
    import tomllib

    from load_tests import package_links

    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    stale = tmp_path / "radixserve" / "lang"
    stale.parent.mkdir(parents=True)
    stale.symlink_to(tmp_path)
    assert package_links.link(tmp_path) == sorted(mapping)
    for name, folder in mapping.items():
        assert tmp_path.joinpath(*name.split(".")).resolve() == (ROOT / folder).resolve()
    assert package_links.link(tmp_path) == sorted(mapping)
