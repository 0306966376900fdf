"""bench_serving's datasets and statistics (no server; the live run is in test_server_cli.py)."""

from __future__ import annotations

import pytest

from load_tests import bench_datasets, bench_serving


def test_shared_prefix_groups_share_exactly_their_system_prompt():
    convs = bench_datasets.shared_prefix_dataset(3, 4, 50, 8, 16, seed=0)
    assert len(convs) == 12 and all(len(c.turns) == 1 for c in convs)
    systems = {}
    for c in convs:
        system, question = c.turns[0].messages
        assert system["role"] == "system" and question["role"] == "user"
        assert len(system["content"].split()) == 3 + 50 and c.turns[0].output_len == 16
        systems.setdefault(c.group, set()).add(system["content"])
    assert sorted(systems) == [0, 1, 2] and all(len(s) == 1 for s in systems.values())
    assert len({next(iter(s)) for s in systems.values()}) == 3
    assert [c.group for c in convs] != sorted(c.group for c in convs)  # interleaved


def test_random_and_multi_turn_shapes():
    convs = bench_datasets.random_dataset(20, 40, 10, 0.5, seed=1)
    lens = [len(c.turns[0].messages[0]["content"].split()) - 1 for c in convs]
    assert all(20 <= n <= 40 for n in lens) and len(set(lens)) > 1
    assert all(5 <= c.turns[0].output_len <= 10 for c in convs)
    assert bench_datasets.random_dataset(20, 40, 10, 0.5, seed=1)[3].turns == convs[3].turns
    mt = bench_datasets.multi_turn_dataset(2, 3, 10, 5, seed=0)
    assert [len(c.turns) for c in mt] == [3, 3] and all(c.chained for c in mt)


def test_percentiles_interpolate_and_report_ms():
    p = bench_serving.percentiles([0.001 * i for i in range(1, 101)])
    assert p["mean"] == pytest.approx(50.5) and p["median"] == pytest.approx(50.5)
    assert p["p99"] == pytest.approx(99.01)
    assert bench_serving.percentiles([]) == {"mean": 0.0, "median": 0.0, "p99": 0.0}


def test_summary_counts_usage_and_cache_hit_rate():
    R = bench_serving.Result
    rs = [
        R(
            ok=True,
            prompt_tokens=100,
            completion_tokens=5,
            cached_tokens=80,
            ttft=0.1,
            e2e=0.5,
            itl=[0.1] * 4,
        ),
        R(ok=True, prompt_tokens=100, completion_tokens=1, cached_tokens=0, ttft=0.2, e2e=0.2),
        R(ok=False, error="HTTP 503: busy"),
    ]
    s = bench_serving.summarize(rs, 2.0, "m")
    assert (s["completed"], s["failed"], s["errors"]) == (2, 1, ["HTTP 503: busy"])
    assert (s["input_throughput"], s["output_throughput"], s["request_throughput"]) == (100, 3, 1)
    assert s["cache_hit_rate"] == 0.4
    assert s["tpot_ms"]["mean"] == pytest.approx(100.0)  # (0.5 - 0.1) / 4, the 1-token one excluded
    assert s["itl_ms"]["median"] == pytest.approx(100.0)
    assert s["ttft_s"] == [0.1, 0.2, None]  # per request in the order sent, for the output file


def test_sse_lines():
    assert bench_serving.parse_sse_line('data: {"a": 1}') == {"a": 1}
    assert bench_serving.parse_sse_line("data: [DONE]") == "[DONE]"
    assert bench_serving.parse_sse_line(": keep-alive") is None


def test_the_floor_is_the_prompt_flops_at_the_gemm_rate_plus_the_decode_steps_at_the_bandwidth():
    from load_tests import floor
    from load_tests.gpu_model import Shape

    shape = Shape(layers=2, hidden=8, heads=2, kv_heads=1, intermediate=16, vocab=10)
    machine = floor.Machine(gemm_flops=1e9, gemm_dtype="float32", bandwidth=1e6)
    requests = [{"prompt": 10, "cached": 4, "output": 5}, {"prompt": 10, "cached": 0, "output": 5}]
    f = floor.workload_floor(machine, shape, requests, concurrency=2, bytes_per_weight=2)
    assert f["prompt_tokens_computed"] == 16
    # each request's own new tokens over its own cached prefix
    prompt_flops = shape.prefill_flops(1, 6, 4) + shape.prefill_flops(1, 10, 0)
    assert prompt_flops < shape.prefill_flops(2, 10, 0)
    assert f["prefill_s"] == pytest.approx(prompt_flops / 1e9)
    # 10 output tokens at batch 2 = 5 steps over a mean context of 12.5 -> 12 tokens; each moves its
    # bytes at 1 MB/s, which is slower than its FLOPs at 1 GFLOP/s
    assert (f["decode_steps"], f["decode_batch"]) == (5, 2)
    assert f["decode_step_s"] == pytest.approx(shape.decode_bytes(2, 12, 2) / 1e6)
    assert f["floor_s"] == pytest.approx(f["prefill_s"] + 5 * f["decode_step_s"])
    # compute-bound steps: the FLOPs bound wins
    fast_memory = floor.Machine(gemm_flops=1e6, gemm_dtype="float32", bandwidth=1e12)
    g = floor.workload_floor(fast_memory, shape, requests, concurrency=2, bytes_per_weight=2)
    assert g["decode_step_s"] == pytest.approx(shape.prefill_flops(2, 1, 12) / 1e6)


def test_the_floor_takes_the_best_reuse_any_server_reached(monkeypatch, capsys):
    from load_tests import floor
    from load_tests.gpu_model import Shape

    shape = Shape(layers=1, hidden=4, heads=1, kv_heads=1, intermediate=4, vocab=4)
    monkeypatch.setattr(floor, "load_shape", lambda model: shape)
    reports = {
        "a": {"failed": 0, "duration_s": 2.0, "requests": [[10, 8, 3], [10, 0, 3]]},
        "b": {"failed": 0, "duration_s": 4.0, "requests": [[10, 0, 3], [10, 6, 3]]},
    }
    args = bench_serving.parse_args(["--base-url", "x", "--max-concurrency", "2"])
    f = bench_serving.add_floor(reports, floor.Machine(1e3, "float32", 1e3), args)
    # a's requests whole (it cached more in all): per-request maxima would claim reuse no server had
    assert f["prompt_tokens_computed"] == 2 + 10
    assert reports["b"]["x_floor"] == pytest.approx(2 * reports["a"]["x_floor"])
    assert reports["a"]["x_floor"] == pytest.approx(2.0 / f["floor_s"])
    bench_serving.print_floor(f, reports)
    out = capsys.readouterr().out
    assert out.startswith("floor of the default model (0M weights; --floor-model for another): 12 prompt")
    assert "x floor: a " in out and "b " in out
