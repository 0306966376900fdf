"""Tenants on a live cluster: one Ray instance, one Serve app (two engine replicas, cache-aware
routing, the default model) with a keys file of two tenants and an admin key.

The tests run in order on the same app: cache and routing isolation, aborts, admin routes.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.serve_utils import running_app

pytestmark = pytest.mark.slow  # starts a live Ray Serve app

DP = 2
SYNC_S = 1.0
KEYS = {"acme": "sk-acme-1", "globex": "sk-globex-1"}
ADMIN = "sk-admin-1"
SYSTEM = "You are a careful assistant for a small bakery. " + " ".join(
    f"Rule {i}: answer in one short sentence about bread number {i}." for i in range(12)
)


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    keys_file = tmp_path_factory.mktemp("tenants") / "keys.yaml"
    keys_file.write_text("".join(f"{tenant}: {key}\n" for tenant, key in KEYS.items()))
    args = {
        "dp": DP,
        "replica_num_cpus": 0.5,
        "max_total_tokens": 4096,
        "num_threads": 1,
        "router_sync_interval_s": SYNC_S,
        "api_keys_file": str(keys_file),
        "admin_api_key": ADMIN,
    }
    with running_app(args) as base:
        yield base


def client_for(url: str, key: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=url, headers=headers, timeout=120)


@pytest.fixture(scope="module")
def acme(url):
    with client_for(url, KEYS["acme"]) as c:
        yield c


@pytest.fixture(scope="module")
def globex(url):
    with client_for(url, KEYS["globex"]) as c:
        yield c


@pytest.fixture(scope="module")
def admin(url):
    with client_for(url, ADMIN) as c:
        yield c


def messages(question: str = "Which bread is best?") -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def requests_per_replica(admin: httpx.Client) -> dict[str, int]:
    return {
        r["replica_id"]: r["num_requests_total"] for r in admin.get("/get_server_info").json()["replicas"]
    }


def serve_one(client: httpx.Client, admin: httpx.Client) -> tuple[str, int]:
    """One chat request; returns (the replica that served it, its cached tokens)."""
    before = requests_per_replica(admin)
    r = client.post("/v1/chat/completions", json={"messages": messages(), "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    after = requests_per_replica(admin)
    (served,) = [x for x in after if after[x] != before.get(x, 0)]
    return served, r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def wait_until(condition, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return result


def wait_for_a_sync_round(admin: httpx.Client) -> None:
    """Until the ingress has applied every replica's report from a round started after now."""
    start = admin.get("/get_server_info").json()["router"]["summaries_applied_total"]

    def applied() -> bool:
        return admin.get("/get_server_info").json()["router"]["summaries_applied_total"] >= start + 2 * DP

    wait_until(applied, "a full round of replica reports")


def wait_idle(admin: httpx.Client) -> None:
    def idle() -> bool:
        replicas = admin.get("/get_server_info").json()["replicas"]
        return all(r["running"] == 0 and r["queued"] == 0 and r["kv_protected"] == 0 for r in replicas)

    wait_until(idle, "idle replicas")


def test_each_tenant_caches_and_routes_its_own_prompts(acme, globex, admin):
    n = len(acme.post("/v1/tokenize", json={"messages": messages()}).json()["tokens"])
    assert n > 150
    home, cached = serve_one(acme, admin)
    assert cached == 0
    assert serve_one(acme, admin) == (home, n - 1)  # its own cache: all but the last token
    # globex's identical prompt neither hits acme's cache nor follows it to acme's replica: it
    # is a new prefix in globex's namespace, for the replica claiming fewer tokens.
    other, cached = serve_one(globex, admin)
    assert other != home and cached == 0
    assert serve_one(globex, admin) == (other, n - 1)
    # The replicas' reports name each prefix's tenant: after a round, both still route home.
    wait_for_a_sync_round(admin)
    assert serve_one(acme, admin) == (home, n - 1)
    assert serve_one(globex, admin) == (other, n - 1)
    # The shared namespace (the admin's) sees neither tenant's cache.
    assert serve_one(admin, admin)[1] == 0


def stream_completion(client: httpx.Client, rid: str):
    return client.stream(
        "POST",
        "/v1/completions",
        json={
            "prompt": "Tell a long story.",
            "max_tokens": 3000,
            "ignore_eos": True,
            "stream": True,
            "rid": rid,
        },
    )


def data_lines(lines) -> list[str]:
    return [line[6:] for line in lines if line.startswith("data: ")]


def test_a_tenant_aborts_only_its_own_requests(acme, globex, admin):
    with stream_completion(acme, "job-1") as s:
        lines = s.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        # Another tenant's abort of that id gets exactly the answer an unknown id gets.
        assert globex.post("/abort_request", json={"rid": "job-1"}).json() == {
            "rid": "job-1",
            "aborted": False,
        }
        assert globex.post("/abort_request", json={"rid": "no-such"}).json() == {
            "rid": "no-such",
            "aborted": False,
        }
        for _ in range(3):  # acme's request goes on
            next(line for line in lines if line.startswith("data: "))
        assert acme.post("/abort_request", json={"rid": "job-1"}).json() == {"rid": "job-1", "aborted": True}
        events = data_lines(lines)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
    # The admin aborts any tenant's request by its qualified id.
    with stream_completion(acme, "job-2") as s:
        lines = s.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        assert admin.post("/abort_request", json={"rid": "job-2"}).json()["aborted"] is False
        assert admin.post("/abort_request", json={"rid": "acme/job-2"}).json()["aborted"] is True
        events = data_lines(lines)
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
    wait_idle(admin)


def test_admin_routes_need_the_admin_key(url, acme, globex, admin):
    r = globex.post("/flush_cache")
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"
    wait_idle(admin)
    r = admin.post("/flush_cache")
    assert r.status_code == 200 and r.json()["success"] is True
    assert serve_one(acme, admin)[1] == 0  # the flush emptied every tenant's cache
    # Server info and metrics stay readable by tenants, with every key setting masked.
    info = globex.get("/get_server_info").json()
    assert (info["api_keys_file"], info["admin_api_key"], info["api_key"]) == ("***", "***", None)
    assert globex.get("/metrics").status_code == 200
    with client_for(url, None) as anonymous:
        assert anonymous.get("/v1/models").status_code == 401
        assert anonymous.get("/health").status_code == 200
