"""A tensor-parallel replica behind the HTTP server: one Ray instance and one Serve app for the
module, the default model at tp_size 2 (6 + 3 query heads over the two ranks). Rank 0 is the Serve
replica, rank 1 a Ray actor in the replica's placement group."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import ray

from tests.serve_utils import abort_mid_stream, running_app, wait_idle

pytestmark = pytest.mark.slow  # starts a live Ray Serve app

KV_TOTAL = 2048


@pytest.fixture(scope="module")
def url():
    args = {"tp_size": 2, "max_total_tokens": KV_TOTAL, "num_threads": 1, "replica_num_cpus": 1}
    with running_app(args, num_cpus=4) as base:  # room for a replacement's group beside the old one
        yield base


@pytest.fixture(scope="module")
def http(url):
    with httpx.Client(base_url=url, timeout=120) as c:
        yield c


def replica(http) -> dict:
    (r,) = http.get("/get_server_info").json()["replicas"]
    return r


def rank_actors() -> list[tuple[str, str]]:
    return sorted(
        (a["namespace"], a["name"])
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("EngineRank::")
    )


def test_streaming_equals_non_streaming(http):
    body = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}
    full = http.post("/v1/completions", json=body)
    assert full.status_code == 200, full.text
    text = full.json()["choices"][0]["text"]
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        assert s.status_code == 200
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == text
    assert len(rank_actors()) == 1  # rank 1 of the one replica
    wait_idle(http, KV_TOTAL)  # rank 0's; the other rank's pool is never allocated from


def test_abort_frees_the_kv(http):
    wait_idle(http, KV_TOTAL)  # rank 0's; the other rank's pool is never allocated from

    def holds_slots() -> None:
        assert replica(http)["kv_protected"] > 0  # the running request holds slots

    abort_mid_stream(http, while_running=holds_slots)
    wait_idle(http, KV_TOTAL)


def test_a_killed_rank_takes_its_replica_down_and_serve_replaces_it(url, http):
    """ray.kill of rank 1: rank 0's engine stops with the rank's name, /ready answers 503, the
    replica's health check fails, Serve replaces the replica (with a rank 1 of its own), and
    requests are served again."""
    old = replica(http)["replica_id"]
    ((namespace, name),) = rank_actors()
    assert old in name
    ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
    with httpx.Client(base_url=url, timeout=60) as anon:
        # Rank 0 stops at once: no replica is ready until Serve's replacement is.
        deadline = time.monotonic() + 60
        while anon.get("/ready").status_code != 503:
            assert time.monotonic() < deadline, "the replica still counts as ready"
            time.sleep(0.2)
    deadline = time.monotonic() + 420
    new = old
    while new == old:
        assert time.monotonic() < deadline, "Serve did not replace the replica"
        time.sleep(1)
        try:
            replicas = http.get("/get_server_info", timeout=10).json()["replicas"]
        except (httpx.HTTPError, ValueError):
            continue
        new = replicas[0]["replica_id"] if len(replicas) == 1 else old
    with httpx.Client(base_url=url, timeout=120) as anon:
        while anon.get("/ready").status_code != 200:
            assert time.monotonic() < deadline, "the replacement replica never became ready"
            time.sleep(1)
    ((_, new_name),) = rank_actors()
    assert new in new_name
    full = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "temperature": 0})
    assert full.status_code == 200 and full.json()["usage"]["completion_tokens"] == 4
    wait_idle(http, KV_TOTAL)  # rank 0's; the other rank's pool is never allocated from
