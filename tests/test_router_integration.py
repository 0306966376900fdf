"""Cache-aware routing on a live cluster: one Ray instance, one Serve app with two engine replicas
(small KV pools, one thread each) behind two ingress replicas, each with its own prefix tree that
the replicas' reports correct every second.

The tests run in order on the same app: affinity, spreading, then a replica is killed.
"""

from __future__ import annotations

import random
import time

import httpx
import pytest
import ray

from tests.serve_utils import running_app

pytestmark = pytest.mark.slow  # starts a live Ray Serve app

KV_TOTAL = 2048
SYNC_S = 1.0
DP = 2
INGRESSES = 2
WORDS = (
    "river garden music window table paper market light voice field song planet ocean "
    "bridge engine signal winter summer forest island mountain letter picture"
).split()


@pytest.fixture(scope="module")
def http():
    args = {
        "dp": DP,
        "ingress_replicas": INGRESSES,
        "replica_num_cpus": 0.5,
        "max_total_tokens": KV_TOTAL,
        "num_threads": 1,
        "router_sync_interval_s": SYNC_S,
    }
    with running_app(args) as base, httpx.Client(base_url=base, timeout=120) as client:
        yield client


def system_prompt(group: int, n_words: int = 250) -> str:
    rng = random.Random(group)
    return f"You are assistant {group}. " + " ".join(rng.choice(WORDS) for _ in range(n_words))


def messages(group: int, question: int) -> list[dict]:
    return [
        {"role": "system", "content": system_prompt(group)},
        {"role": "user", "content": f"Question {question}: what comes next?"},
    ]


def ask(http: httpx.Client, group: int, question: int) -> dict:
    r = http.post(
        "/v1/chat/completions",
        json={"messages": messages(group, question), "max_tokens": 4, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    return r.json()


def token_ids(http: httpx.Client, group: int, question: int) -> list[int]:
    return http.post("/v1/tokenize", json={"messages": messages(group, question)}).json()["tokens"]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def requests_per_replica(http: httpx.Client) -> dict[str, int]:
    info = http.get("/get_server_info").json()
    return {r["replica_id"]: r["num_requests_total"] for r in info["replicas"]}


def wait_for_every_ingress(http: httpx.Client, ok, what: str, timeout: float = 60.0) -> None:
    """Poll /get_server_info (each call lands on some ingress) until the latest router view of
    every ingress satisfies ok(view, the first view seen of that ingress)."""
    first: dict[str, dict] = {}
    latest: dict[str, dict] = {}
    deadline = time.monotonic() + timeout
    while True:
        view = http.get("/get_server_info").json()["router"]
        first.setdefault(view["instance_id"], view)
        latest[view["instance_id"]] = view
        if len(latest) == INGRESSES and all(ok(v, first[i]) for i, v in latest.items()):
            return
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {latest}"
        time.sleep(0.2)


def settle(http: httpx.Client) -> None:
    """Until every ingress has applied each replica's report from a round started after now (a
    round in flight when first seen adds at most DP; the next one starts after it)."""

    def next_round_applied(view: dict, start: dict) -> bool:
        return view["summaries_applied_total"] >= start["summaries_applied_total"] + 2 * DP

    wait_for_every_ingress(http, next_round_applied, "a full round of replica reports")


def serve_one(http: httpx.Client, group: int, question: int) -> tuple[str, int]:
    """Send one request; returns (the replica that served it, its cached tokens)."""
    before = requests_per_replica(http)
    body = ask(http, group, question)
    after = requests_per_replica(http)
    (served,) = [r for r in after if after[r] != before.get(r, 0)]
    assert after[served] == before[served] + 1
    return served, body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_requests_sharing_a_prefix_land_on_one_replica(http):
    first, cached = serve_one(http, group=1, question=0)
    assert cached == 0
    settle(http)  # the other ingress learns where group 1 lives from the reports
    prompts = [token_ids(http, 1, 0)]
    for q in range(1, 5):
        replica, cached = serve_one(http, group=1, question=q)
        ids = token_ids(http, 1, q)
        assert replica == first
        # Exactly the longest prefix shared with an earlier prompt of the group (> 250 tokens).
        assert cached == max(common_prefix(ids, p) for p in prompts) > 250
        prompts.append(ids)
    snap = http.get("/get_server_info").json()["router"]
    assert snap["policy"] == "cache_aware" and len(snap["replicas"]) == 2
    assert snap["tree_tokens_by_replica"][first] > 250


def test_different_prefixes_spread_over_both_replicas(http):
    home = {}
    for group in (2, 3, 4):
        home[group], cached = serve_one(http, group, question=0)
        settle(http)
    replicas = set(requests_per_replica(http))
    assert set(home.values()) == replicas  # both replicas took new groups
    for group in (2, 3, 4):
        replica, cached = serve_one(http, group, question=1)
        assert replica == home[group]
        assert cached == common_prefix(token_ids(http, group, 0), token_ids(http, group, 1))


def scrape(http: httpx.Client) -> str:
    return http.get("/metrics").text


def test_router_metrics(http):
    text = scrape(http)
    for name in (
        "router_requests_total",
        "router_prefix_hits_total",
        "router_prefix_misses_total",
        "router_imbalance_fallbacks_total",
        "router_tree_tokens",
        "router_tree_nodes",
        "router_in_flight_requests",
        "router_tree_replica_tokens",
    ):
        assert f"radixserve:{name}" in text, name

    def hits(text: str) -> list[float]:
        return [
            float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith("radixserve:router_prefix_hits_total{")
        ]

    # Each ingress counts its own routing and a scrape lands on one of them, which may have taken
    # none of the group's repeats: scrape until an ingress that routed a cache hit answers.
    seen = [hits(text)]
    deadline = time.monotonic() + 30
    while not any(h and h[0] >= 1 for h in seen) and time.monotonic() < deadline:
        seen.append(hits(scrape(http)))
    assert all(len(h) == 1 for h in seen)
    assert max(h[0] for h in seen) >= 1, seen


def kill_replica(replica_id: str) -> None:
    name = f"SERVE_REPLICA::radixserve#EngineReplica#{replica_id}"
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)


def test_killing_a_replica_does_not_stop_the_service(http):
    victim, _ = serve_one(http, group=1, question=10)
    survivor = next(r for r in requests_per_replica(http) if r != victim)
    kill_replica(victim)
    # Group 1 lived on the victim: its requests must now be served (by the survivor).
    for q in range(11, 15):
        assert ask(http, 1, q)["choices"][0]["finish_reason"] in ("length", "stop")

    def gone(view: dict, first: dict) -> bool:  # its own failure or Serve's update
        return all(victim not in view[k] for k in ("replicas", "in_flight", "tree_tokens_by_replica"))

    wait_for_every_ingress(http, gone, "every ingress to drop the dead replica")
    # Serve replaces the dead replica; the new one joins the policy and takes new groups.
    wait_for_every_ingress(http, lambda v, _: len(v["replicas"]) == DP, "the replacement", timeout=90)
    replacement = next(r for r in requests_per_replica(http) if r not in (victim, survivor))
    settle(http)
    homes = {serve_one(http, group, question=0)[0] for group in (20, 21)}
    assert replacement in homes
