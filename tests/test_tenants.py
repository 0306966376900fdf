"""Tenants and LoRA adapters on a live cluster: one Ray instance, one Serve app (two engine
replicas, cache-aware routing, the default model, a LoRA adapter served from the start) with a
keys file of two tenants and an admin key.

The tests run in order on the same app: cache and routing isolation, aborts, admin routes, then
adapters: as models, against transformers with the adapter merged, in the cache's namespaces,
loaded and unloaded at run time.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.lora_utils import default_model_dir, hf_greedy, make_adapter, merged_hf
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
def base_dir() -> str:
    return default_model_dir()


@pytest.fixture(scope="module")
def adapters(base_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "baker": make_adapter(base_dir, str(root / "baker"), seed=11, r=8, std=0.1),
        "late": make_adapter(base_dir, str(root / "late"), seed=12, r=4, targets=["o_proj"], std=0.1),
    }


@pytest.fixture(scope="module")
def url(tmp_path_factory, adapters):
    keys_file = tmp_path_factory.mktemp("tenants") / "keys.yaml"
    keys_file.write_text("".join(f"{tenant}: {key}\n" for tenant, key in KEYS.items()))
    args = {
        "lora_paths": [f"baker={adapters['baker']}"],
        "max_loras_per_batch": 2,
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


def greedy_ids(client: httpx.Client, ids: list[int], lora: str | None, n: int = 8) -> list[int]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    if lora is not None:
        body["lora_path"] = lora
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def test_an_adapter_is_a_model_that_answers_as_transformers_merged(acme, admin, base_dir, adapters):
    models = {m["id"]: m for m in acme.get("/v1/models").json()["data"]}
    base = next(m for m in models.values() if "parent" not in m)["id"]
    assert models["baker"]["parent"] == base and models["baker"]["root"] == adapters["baker"]
    ids = acme.post("/v1/tokenize", json={"prompt": "The best bread is"}).json()["tokens"]
    want = hf_greedy(merged_hf(base_dir, adapters["baker"]), ids, 8)
    assert want != hf_greedy(merged_hf(base_dir, None), ids, 8)
    assert greedy_ids(acme, ids, "baker") == want
    body = {"model": "baker", "messages": messages(), "max_tokens": 4, "temperature": 0}
    r = acme.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.json()["model"] == "baker", r.text
    for path, payload in [
        ("/v1/chat/completions", {**body, "model": "nope"}),
        ("/v1/completions", {"model": "nope", "prompt": "a", "max_tokens": 1}),
        ("/generate", {"text": "a", "lora_path": "nope"}),
    ]:
        r = acme.post(path, json=payload)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", (path, r.text)
    assert acme.get("/v1/models/nope").status_code == 404
    wait_idle(admin)


def test_the_cache_is_kept_apart_by_adapter_and_by_tenant(acme, globex, admin):
    chat = [{"role": "system", "content": "Pastry rule: " + "flour, water, salt. " * 40}]
    chat.append({"role": "user", "content": "Which rye?"})  # a prefix no earlier test sent

    def cached(client: httpx.Client, model: str | None) -> int:
        body = {"messages": chat, "max_tokens": 2, "temperature": 0}
        r = client.post("/v1/chat/completions", json=body if model is None else {**body, "model": model})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    n = len(acme.post("/v1/tokenize", json={"messages": chat}).json()["tokens"])
    # New to the adapter's namespace but for the role header, which an earlier baker chat of
    # acme's began with (cached where it was routed, so 0 or the header).
    assert cached(acme, "baker") < 8
    assert cached(acme, "baker") == n - 1  # routed home, into the adapter's namespace
    assert cached(globex, "baker") == 0  # another tenant, the same adapter: its own namespace
    # The base model shares nothing with the adapter: at most the template's role header, which
    # acme's earlier base-model chats began with too.
    assert cached(acme, None) < 8
    wait_idle(admin)


def test_adapters_load_and_unload_at_run_time(acme, admin, base_dir, adapters, tmp_path):
    body = {"lora_name": "late", "lora_path": adapters["late"]}
    r = acme.post("/load_lora_adapter", json=body)
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"
    r = admin.post("/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(tmp_path)})
    assert r.status_code == 400 and "not a LoRA adapter directory" in r.json()["error"]["message"], r.text
    r = admin.post("/load_lora_adapter", json=body)
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    assert "late" in {m["id"] for m in acme.get("/v1/models").json()["data"]}
    ids = acme.post("/v1/tokenize", json={"prompt": "Bake me"}).json()["tokens"]
    assert greedy_ids(acme, ids, "late") == hf_greedy(merged_hf(base_dir, adapters["late"]), ids, 8)
    info = admin.get("/get_server_info").json()["replicas"]
    assert all(r["lora_adapters"] == {"baker": adapters["baker"], "late": adapters["late"]} for r in info)
    assert admin.post("/unload_lora_adapter", json={"lora_name": "late"}).json()["success"] is True
    r = acme.post("/generate", json={"text": "a", "lora_path": "late"})
    assert r.status_code == 404, r.text
    r = admin.post("/unload_lora_adapter", json={"lora_name": "late"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    wait_idle(admin)
