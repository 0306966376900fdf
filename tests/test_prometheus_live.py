"""A live one-machine deployment, watched as an operator watches it: `radixserve serve` (two engine
replicas, its own Ray with a metrics export port) under load, scraped by a real Prometheus
(Debian's package) run with deploy/prometheus.yml and deploy/alerts.yml.

- Every expression of every dashboard in deploy/grafana/ returns data through Prometheus's HTTP
  API, including the Serve rows read from Ray's own metrics (replicas per deployment).
- Every alert rule evaluates without error against the real series, and none fires.
- The Ray that `radixserve serve` starts listens on loopback only, but for the one socket Ray
  Serve binds to `[::]` unconditionally (each replica's inter-deployment gRPC server), which
  refuses callers without Ray's auth token.
"""

from __future__ import annotations

import ipaddress
import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import psutil
import pytest
import yaml

from tests.serve_utils import free_port
from tests.test_server_cli import start, stop

pytestmark = pytest.mark.slow  # starts a live Ray Serve app

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
DATA_DEADLINE_S = 240  # Serve's replica gauges are first reported a minute or two after start


@dataclass
class App:
    proc: subprocess.Popen
    url: str
    port: int
    ray_metrics_port: int


@pytest.fixture(scope="module")
def app(tmp_path_factory) -> Iterator[App]:
    port, ray_metrics_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    # README: radixserve serve --dp 2 --ray-metrics-export-port 8080
    cmd = [str(Path(sys.executable).parent / "radixserve"), "serve", "--port", str(port), "--dp", "2"]
    cmd += ["--num-threads", "1", "--max-total-tokens", "2048", "--router-sync-interval-s", "1"]
    cmd += ["--ray-metrics-export-port", str(ray_metrics_port)]
    proc = start(cmd, url, tmp_path_factory.mktemp("cli") / "cli.log")
    try:
        yield App(proc, url, port, ray_metrics_port)
    finally:
        stop(proc, signal.SIGTERM)


@pytest.fixture(scope="module")
def prometheus_bin() -> str:
    if shutil.which("prometheus") is None:
        if shutil.which("apt-get") is None:
            pytest.skip("prometheus is not installed and apt-get is unavailable to install it")
        subprocess.run(["bash", str(DEPLOY / "apt-install.sh"), "prometheus"], check=True, timeout=600)
    path = shutil.which("prometheus")
    assert path, "deploy/apt-install.sh prometheus did not install prometheus"
    return path


def prometheus_config(app: App) -> dict:
    """deploy/prometheus.yml for this test: its ports, a 1 s scrape, and the one-machine form of
    the `ray` job that the file documents (a static target instead of the head's discovery file)."""
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(DEPLOY / f) for f in config["rule_files"]]
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert set(jobs) == {"radixserve", "ray"}
    jobs["radixserve"]["static_configs"] = [{"targets": [f"127.0.0.1:{app.port}"]}]
    del jobs["ray"]["file_sd_configs"]
    jobs["ray"]["static_configs"] = [{"targets": [f"127.0.0.1:{app.ray_metrics_port}"]}]
    return config


@pytest.fixture(scope="module")
def prometheus(app, prometheus_bin, tmp_path_factory) -> Iterator[httpx.Client]:
    d = tmp_path_factory.mktemp("prometheus")
    (d / "prometheus.yml").write_text(yaml.safe_dump(prometheus_config(app)))
    port = free_port()
    log = (d / "prometheus.log").open("w")
    # README: prometheus --config.file=deploy/prometheus.yml
    proc = subprocess.Popen(
        [
            prometheus_bin,
            f"--config.file={d / 'prometheus.yml'}",
            f"--storage.tsdb.path={d / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (d / "prometheus.log").read_text()[-3000:]
            try:
                if client.get("/-/ready").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "prometheus never became ready"
            time.sleep(0.5)
        yield client
    finally:
        client.close()
        proc.terminate()
        proc.wait(timeout=30)


class Load:
    """Chat requests (a shared system prompt, streamed and not) on a thread, until stopped or
    bounded out: at most `max_requests` or `max_s` seconds."""

    def __init__(self, url: str, max_requests: int = 400, max_s: float = DATA_DEADLINE_S + 60):
        self.url, self.max_requests, self.max_s = url, max_requests, max_s
        self.stopped = threading.Event()
        self.sent = 0
        self.statuses: list[int] = []
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        system = "You are a terse assistant who answers about rivers, bridges and mountains. " * 8
        end = time.monotonic() + self.max_s
        with httpx.Client(base_url=self.url, timeout=120) as c:
            while not self.stopped.is_set() and self.sent < self.max_requests and time.monotonic() < end:
                body = {
                    "messages": [
                        {"role": "system", "content": system},
                        {"role": "user", "content": f"Question {self.sent}: name one."},
                    ],
                    "max_tokens": 6,
                    "ignore_eos": True,
                    "stream": self.sent % 2 == 1,
                }
                r = c.post("/v1/chat/completions", json=body)
                self.statuses.append(r.status_code)
                self.sent += 1

    def __enter__(self) -> Load:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        self.thread.join(timeout=180)


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(dashboard file, panel title, expr) for every target of every dashboard."""
    out = []
    for path in sorted((DEPLOY / "grafana").glob("*.json")):
        dash = json.loads(path.read_text())
        for panel in dash["panels"]:
            for t in panel.get("targets", []):
                out.append((path.name, panel["title"], t["expr"]))
    return out


def instant(prom: httpx.Client, expr: str) -> list[dict]:
    r = prom.get("/api/v1/query", params={"query": expr})
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", (expr, body)
    return body["data"]["result"]


def test_ray_started_by_the_cli_listens_on_loopback_only(app):
    # Serving starts with the first engine replica; every replica's servers must be up to count.
    deadline = time.monotonic() + 180
    while len(httpx.get(app.url + "/get_server_info", timeout=30).json()["replicas"]) < 2:
        assert time.monotonic() < deadline, "the second engine replica did not come up"
        time.sleep(0.5)
    listening: list[tuple[str, str, int]] = []
    family = [psutil.Process(app.proc.pid), *psutil.Process(app.proc.pid).children(recursive=True)]
    for p in family:
        try:
            conns = p.net_connections(kind="inet")
            name = p.name()
        except psutil.NoSuchProcess:
            continue
        listening += [(name, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
    ports = {port for _, _, port in listening}
    # Serve's HTTP proxy and Ray's metrics agent are among them, with GCS, the raylet and workers.
    assert {app.port, app.ray_metrics_port} <= ports
    assert {"gcs_server", "raylet"} <= {name for name, _, _ in listening}

    def loopback(ip: str) -> bool:
        addr = ipaddress.ip_address(ip.split("%")[0])
        mapped = getattr(addr, "ipv4_mapped", None)
        return (mapped or addr).is_loopback

    wildcard = [x for x in listening if not loopback(x[1])]
    # Only Serve's per-replica gRPC servers: one in each of the 2 engine replicas and the ingress.
    assert sorted(name for name, _, _ in wildcard) == [
        "ray::ServeReplica:radixserve:EngineReplica",
        "ray::ServeReplica:radixserve:EngineReplica",
        "ray::ServeReplica:radixserve:Ingress",
    ]
    for name, ip, port in wildcard:
        assert ip in ("::", "0.0.0.0"), (name, ip)
        # A wildcard socket takes loopback connections too: the same server others would reach.
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/ray.serve.ASGIService/HandleRequest")
            with pytest.raises(grpc.RpcError) as refused:
                call(b"", timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, (name, refused.value.details())


def test_every_dashboard_query_returns_data_under_load(app, prometheus):
    model = httpx.get(app.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    queries = dashboard_queries()
    assert any("ray_serve_deployment_replica_healthy" in e for _, _, e in queries)
    # As Grafana sends them: the selected model (regex-escaped, in a PromQL string), all replicas.
    selected = re.escape(model).replace("\\", "\\\\")
    pending = {
        (f, title, expr): expr.replace("$model_name", selected).replace("$replica", ".*")
        for f, title, expr in queries
    }
    results: dict[tuple[str, str, str], list[dict]] = {}
    with Load(app.url) as load:
        deadline = time.monotonic() + DATA_DEADLINE_S
        while pending and time.monotonic() < deadline:
            for key, expr in list(pending.items()):
                if result := instant(prometheus, expr):
                    results[key] = result
                    del pending[key]
            time.sleep(2)
    assert not pending, f"no data after {DATA_DEADLINE_S}s (sent {load.sent} requests): {sorted(pending)}"
    assert load.statuses and set(load.statuses) == {200}

    # Serve's view: both engine replicas and the ingress, healthy, per deployment. The controller
    # exports these gauges on its own period: under load one scrape may still miss a replica.
    expr = "sum by (application, deployment) (ray_serve_deployment_replica_healthy)"
    deadline = time.monotonic() + DATA_DEADLINE_S
    while True:
        healthy = {r["metric"]["deployment"]: float(r["value"][1]) for r in instant(prometheus, expr)}
        if healthy == {"EngineReplica": 2.0, "Ingress": 1.0} or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert healthy == {"EngineReplica": 2.0, "Ingress": 1.0}
    target = instant(prometheus, "max by (application, deployment) (ray_serve_autoscaling_target_replicas)")
    assert {r["metric"]["deployment"]: float(r["value"][1]) for r in target} == {
        "EngineReplica": 2.0,
        "Ingress": 1.0,
    }
    # And the server's: requests were finished, on two replicas.
    finished = [
        r for (_, _, e), r in results.items() if e.startswith("sum(rate(radixserve:num_requests_total")
    ]
    assert finished and all(float(r[0]["value"][1]) > 0 for r in finished)
    replicas = instant(prometheus, f'radixserve:kv_total_tokens{{model_name="{model}"}}')
    assert sorted(float(r["value"][1]) for r in replicas) == [2048.0, 2048.0]


def test_grafana_variables_resolve(app, prometheus):
    model = httpx.get(app.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    r = prometheus.get("/api/v1/label/model_name/values", params={"match[]": "radixserve:kv_total_tokens"})
    assert r.json()["data"] == [model]
    r = prometheus.get("/api/v1/label/replica/values", params={"match[]": "radixserve:kv_total_tokens"})
    assert len(r.json()["data"]) == 2


def test_both_jobs_are_scraped_and_every_alert_rule_evaluates_quietly(app, prometheus):
    targets = prometheus.get("/api/v1/targets").json()["data"]["activeTargets"]
    assert {t["labels"]["job"]: t["health"] for t in targets} == {"radixserve": "up", "ray": "up"}
    groups = prometheus.get("/api/v1/rules").json()["data"]["groups"]
    rules = [r for g in groups for r in g["rules"]]
    expected = [
        r["alert"] for g in yaml.safe_load((DEPLOY / "alerts.yml").read_text())["groups"] for r in g["rules"]
    ]
    assert [r["name"] for r in rules] == expected
    deadline = time.monotonic() + 30
    while any(r.get("health") != "ok" for r in rules):  # each has been evaluated, without error
        assert time.monotonic() < deadline, [(r["name"], r.get("health"), r.get("lastError")) for r in rules]
        time.sleep(1)
        rules = [r for g in prometheus.get("/api/v1/rules").json()["data"]["groups"] for r in g["rules"]]
    # A healthy app leaves every rule inactive. One evaluated on a scrape that missed a gauge (see
    # above) may show pending until the next evaluation; none may stay so.
    deadline = time.monotonic() + 30
    while (active := [(r["name"], r["state"]) for r in rules if r["state"] != "inactive"]) and (
        time.monotonic() < deadline
    ):
        time.sleep(1)
        rules = [r for g in prometheus.get("/api/v1/rules").json()["data"]["groups"] for r in g["rules"]]
    assert active == []
