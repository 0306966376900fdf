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


def test_sse_lines():
    assert bench_serving.parse_sse_line('data: {"a": 1}') == {"a": 1}
    assert bench_serving.parse_sse_line("data: [DONE]") == "[DONE]"
    assert bench_serving.parse_sse_line(": keep-alive") is None
