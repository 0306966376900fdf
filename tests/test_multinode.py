"""More than one node, on one machine: a Ray cluster of a head (no CPUs: Serve's controller, HTTP
proxy and the ingress) and three worker nodes of one CPU each (ray.cluster_utils.Cluster), with
the app deployed from deploy/serve.yaml as `serve deploy` applies a config (the Serve
controller's apply_config), two engine replicas of one CPU, one thread and a small KV pool.

The tests run in order on the same cluster, as an operator's day goes:
1. the replicas spread over the nodes (one CPU each: never two on a node);
2. a node is lost while requests run: streams that had started on its replica end with an
   in-band error (not a hang), those on the other replica finish, requests sent right after the
   loss are served (the ingress resends those Serve had already sent to the dead replica), Serve
   replaces the replica on the free node, the router forgets the dead replica, and the
   survivor's KV pool is back to idle;
3. a rolling update (`serve deploy` of a changed config) replaces every replica while streams
   run: none fails (serve.yaml gives replicas time to drain: graceful_shutdown_timeout_s);
4. scaling down (num_replicas 2 -> 1 in the config's `deployments:`) drains the replica that
   goes (its streams finish) and keeps the other.
"""

from __future__ import annotations

import contextlib
import json
import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
import yaml
from ray import serve

from tests.serve_utils import free_port

pytestmark = pytest.mark.slow  # starts a multi-node Ray cluster and a live Serve app

REPO = Path(__file__).resolve().parents[1]
APP = "radixserve"
KV_TOTAL = 4096
LONG = 300  # tokens a long stream generates: seconds at one thread on a shared machine
# Streams that must outlast a rolling update's start of new replicas (model load included) while
# the old ones drain: with the default model's decode at 150+ tokens/s a thread, LONG ended first.
# Three of them still fit one replica's KV_TOTAL.
DRAIN = 1200
WORDS = "river garden music window table paper market light voice field song planet ocean".split()


def wait_for(what: str, check: Callable[[], Any], timeout_s: float = 180.0, every_s: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(every_s)


@dataclass
class Env:
    cluster: Any
    url: str
    port: int
    engine_nodes: list = field(default_factory=list)


def serve_config(port: int, engine_replicas: int | None = None, **args: Any) -> dict:
    """deploy/serve.yaml for this cluster: its port, two small one-CPU engine replicas;
    `engine_replicas` sets the engine deployment's num_replicas in its `deployments:` entry."""
    config = yaml.safe_load((REPO / "deploy" / "serve.yaml").read_text())
    config["http_options"]["port"] = port
    (app,) = config["applications"]
    app["args"].update(
        port=port,
        dp=2,
        replica_num_cpus=1,
        num_threads=1,
        max_total_tokens=KV_TOTAL,
        router_policy="cache_aware",  # fixed, so that changing dp changes nothing else
        router_sync_interval_s=1,
    )
    app["args"].update(args)
    if engine_replicas is not None:
        (engine,) = [d for d in app["deployments"] if d["name"] == "EngineReplica"]
        engine["num_replicas"] = engine_replicas
    return config


def deploy(config: dict) -> None:
    """What `serve deploy` / `serve run` do with a config file: the controller applies it."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    _get_global_client().deploy_apps(ServeDeploySchema.model_validate(config))


def engine_states() -> dict[str, int]:
    status = serve.status().applications.get(APP)
    if status is None or "EngineReplica" not in status.deployments:
        return {}
    return dict(status.deployments["EngineReplica"].replica_states)


def replica_nodes() -> dict[str, str]:
    """Alive engine replicas (Serve's replica id) -> the node each runs on."""
    from ray._private.state import actors

    prefix = f"SERVE_REPLICA::{APP}#EngineReplica#"
    return {
        a["Name"][len(prefix) :]: a["Address"]["NodeID"]
        for a in actors().values()
        if a["State"] == "ALIVE" and a.get("Name", "").startswith(prefix)
    }


def server_info(env: Env) -> dict:
    return httpx.get(env.url + "/get_server_info", timeout=30).json()


def replicas_ready(env: Env, n: int) -> dict | None:
    """/get_server_info once Serve runs `n` engine replicas and the ingress sees all of them."""
    if engine_states() != {"RUNNING": n} or serve.status().applications[APP].status != "RUNNING":
        return None
    try:
        info = server_info(env)
    except httpx.HTTPError:
        return None
    return info if len(info["replicas"]) == n else None


@contextlib.contextmanager
def keeping_current_cluster_file() -> Iterator[None]:
    """Cluster records its head in /tmp/ray/ray_current_cluster, where every `ray.init()` or
    `serve run` on this machine without an address would find and join it: put back what was
    there (another instance's record, or nothing)."""
    from ray._common.utils import get_ray_address_file

    path = Path(get_ray_address_file(None))
    before = path.read_text() if path.exists() else None
    try:
        yield
    finally:
        if before is None:
            path.unlink(missing_ok=True)
        else:
            path.write_text(before)


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    from ray.cluster_utils import Cluster

    with keeping_current_cluster_file():
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    engine_nodes = [cluster.add_node(num_cpus=1) for _ in range(3)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    port = free_port()
    env = Env(cluster, f"http://127.0.0.1:{port}", port, engine_nodes)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        deploy(serve_config(port))
        wait_for("two engine replicas", lambda: replicas_ready(env, 2), timeout_s=400)
        yield env
    finally:
        serve.shutdown()
        ray.shutdown()
        with keeping_current_cluster_file():  # shutdown deletes the record, whoever's it is
            cluster.shutdown()


def prompt(group: int) -> str:
    """A prompt of its own: shares only the chat template's few tokens with another group's, so
    the cache-aware router places it by load (streams spread over the replicas)."""
    rng = random.Random(group)
    return f"Story {group}: " + " ".join(rng.choice(WORDS) for _ in range(120))


class Stream:
    """One streamed chat completion on a thread: when each content chunk arrived, how it ended."""

    def __init__(self, url: str, group: int, max_tokens: int = LONG):
        self.body = {
            "messages": [{"role": "user", "content": prompt(group)}],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        self.url = url
        self.chunk_times: list[float] = []
        self.finish_reason: str | None = None
        self.completion_tokens: int | None = None
        self.error: dict | None = None
        self.status: int | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        try:
            with httpx.Client(timeout=httpx.Timeout(60, read=120)) as c:
                with c.stream("POST", self.url + "/v1/chat/completions", json=self.body) as r:
                    self.status = r.status_code
                    for line in r.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        event = json.loads(line[6:])
                        if "error" in event:
                            self.error = event["error"]
                            continue
                        if event.get("usage"):
                            self.completion_tokens = event["usage"]["completion_tokens"]
                        if not event["choices"]:
                            continue
                        choice = event["choices"][0]
                        if choice["delta"].get("content"):
                            self.chunk_times.append(time.monotonic())
                        self.finish_reason = choice.get("finish_reason") or self.finish_reason
        finally:
            self.done.set()

    def started(self) -> bool:
        return bool(self.chunk_times)

    def wait(self, timeout_s: float = 240) -> Stream:
        assert self.done.wait(timeout_s), "the stream hung"
        return self


def chat(env: Env, group: int, max_tokens: int = 4) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": prompt(group)}], "max_tokens": max_tokens}
    return httpx.post(env.url + "/v1/chat/completions", json=body, timeout=120)


def idle(stats: dict) -> bool:
    """The engine invariant at idle: nothing running or queued, nothing protected, every slot
    free or evictable."""
    return (
        stats["running"] == 0
        and stats["queued"] == 0
        and stats["kv_protected"] == 0
        and stats["kv_free"] + stats["kv_evictable"] == stats["kv_total"]
    )


def test_replicas_spread_over_the_nodes(env):
    nodes = replica_nodes()
    assert len(nodes) == 2 and len(set(nodes.values())) == 2  # one replica per node
    engine_node_ids = {n.node_id for n in env.engine_nodes}
    assert set(nodes.values()) <= engine_node_ids  # none on the CPU-less head
    info = server_info(env)
    assert sorted(r["replica_id"] for r in info["replicas"]) == sorted(nodes)
    assert sorted(info["router"]["replicas"]) == sorted(nodes)


def test_losing_a_node_while_requests_run(env):
    streams = [Stream(env.url, group) for group in range(4)]
    wait_for("every stream's first tokens", lambda: all(s.started() for s in streams), timeout_s=180)
    running = {r["replica_id"]: r["running"] for r in server_info(env)["replicas"]}
    nodes = replica_nodes()
    victim = max(running, key=lambda r: (running[r], r))  # the one holding most streams
    (survivor,) = [r for r in running if r != victim]
    assert running[victim] >= 1 and sum(running.values()) == 4, running
    node = next(n for n in env.engine_nodes if n.node_id == nodes[victim])
    env.cluster.remove_node(node, allow_graceful=False)
    env.engine_nodes.remove(node)

    # Requests sent right after the loss are served. Serve may still route some to the dead
    # replica (it learns of the loss a moment later) and does not resend a call it sent: the
    # ingress sends those again, and they land on the live replica.
    with ThreadPoolExecutor(6) as pool:
        codes = list(pool.map(lambda group: chat(env, group).status_code, range(10, 16)))
    assert codes == [200] * 6
    for s in streams:
        s.wait()
    failed = [s for s in streams if s.error is not None]
    finished = [s for s in streams if s.error is None]
    # The victim's streams end with an in-band error after their 200; the survivor's finish.
    assert len(failed) == running[victim] and len(finished) == running[survivor]
    assert all(s.status == 200 and s.error["type"] for s in failed)
    assert all(s.finish_reason == "length" and s.completion_tokens == LONG for s in finished)

    # Serve replaces the lost replica, on the free node; the ingress's router forgets the dead one.
    info = wait_for("a replacement replica", lambda: replicas_ready(env, 2), timeout_s=300)
    nodes = replica_nodes()
    assert victim not in nodes and survivor in nodes and len(set(nodes.values())) == 2
    assert set(nodes.values()) <= {n.node_id for n in env.engine_nodes}
    router = info["router"]
    assert victim not in router["replicas"] and victim not in router["tree_tokens_by_replica"]
    assert victim not in router["in_flight"] and router["replicas_removed_total"] >= 1
    # The survivor's KV pool: every slot its finished streams held is free or cached again.
    wait_for(
        "the survivor idle",
        lambda: idle(next(r for r in server_info(env)["replicas"] if r["replica_id"] == survivor)),
    )
    # The operator brings a node back: room for the next rolling update.
    env.engine_nodes.append(env.cluster.add_node(num_cpus=1))
    env.cluster.wait_for_nodes()


class ReplicaWatch:
    """Serve's engine replica states, polled on a thread: when a replica was first STOPPING."""

    def __init__(self) -> None:
        self.first_stopping: float | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop.is_set():
            if self.first_stopping is None and engine_states().get("STOPPING", 0) > 0:
                self.first_stopping = time.monotonic()
            time.sleep(0.2)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


def check_drained(streams: list[Stream], watch: ReplicaWatch) -> None:
    for s in streams:
        s.wait(timeout_s=400)
    watch.close()
    assert [(s.status, s.error, s.finish_reason) for s in streams] == [(200, None, "length")] * len(streams)
    assert [s.completion_tokens for s in streams] == [DRAIN] * len(streams)
    # Not vacuous: a replica was being drained while streams still produced tokens.
    assert watch.first_stopping is not None
    assert max(t for s in streams for t in s.chunk_times) > watch.first_stopping


def test_rolling_update_fails_no_request(env):
    before = set(replica_nodes())
    streams = [Stream(env.url, group, DRAIN) for group in range(20, 24)]
    wait_for("every stream's first tokens", lambda: all(s.started() for s in streams), timeout_s=180)
    watch = ReplicaWatch()
    deploy(serve_config(env.port, max_running_requests=32))  # a changed engine argument
    check_drained(streams, watch)
    info = wait_for(
        "the updated replicas",
        lambda: not (set(replica_nodes()) & before) and replicas_ready(env, 2),
        timeout_s=400,
    )
    assert info["max_running_requests"] == 32
    assert [chat(env, group).status_code for group in (30, 31)] == [200, 200]


def test_scale_down_drains(env):
    before = set(replica_nodes())
    assert len(before) == 2
    streams = [Stream(env.url, group, DRAIN) for group in range(40, 44)]
    wait_for("every stream's first tokens", lambda: all(s.started() for s in streams), timeout_s=180)
    running = {r["replica_id"]: r["running"] for r in server_info(env)["replicas"]}
    assert all(running[r] >= 1 for r in before), running  # both replicas hold streams
    watch = ReplicaWatch()
    # Scaling is a deployment option, applied in place; changing `dp` (an app argument) would
    # restart every replica like any argument change.
    deploy(serve_config(env.port, engine_replicas=1, max_running_requests=32))
    check_drained(streams, watch)
    info = wait_for("one replica", lambda: replicas_ready(env, 1), timeout_s=300)
    (kept,) = replica_nodes()
    assert kept in before  # scaling down replaced nothing: one of the two stayed
    assert info["router"]["replicas"] == [kept]
    assert idle(info["replicas"][0])
