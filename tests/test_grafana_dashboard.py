"""deploy/grafana: the dashboard is well formed, and every series and label its PromQL queries is
one the server really exposes: a real `Metrics` (router/frontend/metrics.py) fed real `ReplicaStats` and a
real `RoutingState` snapshot, rendered as /metrics renders it. Renaming a metric or a label in
router/frontend/metrics.py without updating the dashboard fails here. No Ray."""

import json
import re
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from radixserve.router.frontend.metrics import PREFIX, Metrics
from radixserve.router.routing.policy import PolicyConfig
from radixserve.router.routing.routing_state import RoutingState
from radixserve.workers.protocol import ReplicaStats

GRAFANA = Path(__file__).resolve().parent.parent / "deploy" / "grafana"
DS_REF = {"type": "prometheus", "uid": "${datasource}"}
SELECTOR = re.compile(r"(radixserve:[A-Za-z0-9_:]+)\s*(\{[^}]*\})?")
LABEL_MATCHER = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)\s*"')
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
LABEL_VALUES = re.compile(r"label_values\(\s*(radixserve:[A-Za-z0-9_:]+)[^,]*,\s*(\w+)\s*\)")


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads((GRAFANA / "radixserve.json").read_text())


@pytest.fixture(scope="module")
def exposed() -> dict[str, set[str]]:
    """Sample name (with _bucket / _sum / _count / _total) -> its label names, from /metrics."""
    metrics = Metrics("smollm2")
    metrics.set_replicas(
        [
            ReplicaStats(
                replica_id="r1",
                running=2,
                queued=1,
                kv_total=4096,
                kv_free=1000,
                kv_evictable=500,
                kv_protected=64,
                prompt_tokens_total=900,
                cached_tokens_total=600,
                computed_tokens_total=300,
                generation_tokens_total=120,
                num_requests_total=3,
                num_aborted_total=1,
            ),
            ReplicaStats(replica_id="r2", kv_total=4096, kv_free=4096),
        ]
    )
    state = RoutingState(PolicyConfig())
    state.set_replicas(["r1", "r2"])
    state.route("req-1", list(range(100, 140)), ["r1", "r2"])
    metrics.set_router(state.snapshot())
    timer = metrics.timer()
    timer.admitted()
    timer.tokens(1)
    timer.tokens(2)
    timer.finished()
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


def panels(dash: dict) -> list[dict]:
    return [p for p in dash["panels"] if p["type"] != "row"]


def exprs(dash: dict) -> list[str]:
    return [t["expr"] for p in panels(dash) for t in p["targets"]]


def unknown_series(queries: list[str], exposed: dict[str, set[str]]) -> list[str]:
    """Every series, matcher label or grouping label in `queries` that /metrics does not have."""
    problems = []
    for expr in queries:
        names = []
        for name, matchers in SELECTOR.findall(expr):
            names.append(name)
            if name not in exposed:
                problems.append(f"{name} (in {expr})")
                continue
            for label in LABEL_MATCHER.findall(matchers):
                if label not in exposed[name]:
                    problems.append(f"{name} has no label {label!r}")
        for group in GROUPING.findall(expr):
            for label in filter(None, (g.strip() for g in group.split(","))):
                for name in names:
                    if name in exposed and label not in exposed[name]:
                        problems.append(f"grouping by {label!r}: {name} has no such label")
    return problems


def test_every_queried_series_and_label_is_exposed(dashboard, exposed):
    assert unknown_series(exprs(dashboard), exposed) == []


def test_a_renamed_metric_or_label_is_caught(dashboard, exposed):
    queries = exprs(dashboard)
    renamed = [q.replace("radixserve:num_queue_reqs", "radixserve:num_queued_reqs") for q in queries]
    assert any("radixserve:num_queued_reqs (in" in p for p in unknown_series(renamed, exposed))
    relabeled = [q.replace('replica=~"$replica"', 'instance_replica=~"$replica"') for q in queries]
    assert "radixserve:num_running_reqs has no label 'instance_replica'" in unknown_series(relabeled, exposed)
    # router counters carry `policy`, not `replica`
    bad_group = ["sum by (replica) (rate(radixserve:router_prefix_hits_total[1m]))"]
    assert unknown_series(bad_group, exposed) == [
        "grouping by 'replica': radixserve:router_prefix_hits_total has no such label"
    ]


def test_every_exposed_metric_has_a_panel(dashboard, exposed):
    """A metric added to router/frontend/metrics.py needs a panel in deploy/grafana/radixserve.json."""
    used = {n for q in exprs(dashboard) for n, _ in SELECTOR.findall(q)}
    used_families = {re.sub(r"_(bucket|sum|count)$", "", n) for n in used}
    families = {re.sub(r"_(bucket|sum|count|created)$", "", n) for n in exposed}
    families = {f for f in families if f.startswith(PREFIX)}
    assert families - used_families == set()


def test_latency_histograms_have_p50_p90_p99(dashboard):
    for hist in (
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
        "queue_time_seconds",
    ):
        quantiles = {
            float(q)
            for e in exprs(dashboard)
            for q in re.findall(
                rf"histogram_quantile\(([0-9.]+), sum by \(le\) \(rate\({PREFIX}{hist}_bucket\{{", e
            )
        }
        assert quantiles == {0.5, 0.9, 0.99}, hist
    for e in exprs(dashboard):  # buckets are only meaningful inside histogram_quantile
        assert ("_bucket" in e) == e.startswith("histogram_quantile("), e


def test_dashboard_structure(dashboard):
    assert dashboard["schemaVersion"] == 39
    assert dashboard["uid"] == "radixserve-overview"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for p in dashboard["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        cover = {(g["y"] + dy, g["x"] + dx) for dy in range(g["h"]) for dx in range(g["w"])}
        assert not cells & cover, f"panel {p['title']!r} overlaps another"
        cells |= cover
    for p in panels(dashboard):
        assert p["datasource"] == DS_REF and p["targets"], p["title"]
        ref_ids = [t["refId"] for t in p["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), p["title"]
        for t in p["targets"]:
            assert t["datasource"] == DS_REF, p["title"]
            e = t["expr"]
            assert e.count("(") == e.count(")") and e.count("{") == e.count("}"), e


def test_template_variables(dashboard, exposed):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert set(variables) == {"datasource", "model_name", "replica"}
    assert (variables["datasource"]["type"], variables["datasource"]["query"]) == ("datasource", "prometheus")
    assert variables["replica"]["multi"] and variables["replica"]["includeAll"]
    for name in ("model_name", "replica"):
        var = variables[name]
        assert var["type"] == "query" and var["datasource"] == DS_REF
        ((metric, label),) = LABEL_VALUES.findall(var["query"]["query"])
        assert label == name and name in exposed[metric]
        assert unknown_series([var["query"]["query"]], exposed) == []
    used = {v for e in exprs(dashboard) for v in re.findall(r"\$(\w+)", e)}
    assert used == {"model_name", "replica"}


def test_provisioning_points_at_prometheus_and_the_dashboard_folder():
    prov = GRAFANA / "provisioning"
    (ds,) = yaml.safe_load((prov / "datasources" / "radixserve.yaml").read_text())["datasources"]
    assert (ds["type"], ds["url"], ds["access"]) == ("prometheus", "http://localhost:9090", "proxy")
    (provider,) = yaml.safe_load((prov / "dashboards" / "radixserve.yaml").read_text())["providers"]
    assert provider["type"] == "file"
    readme = (GRAFANA / "README.md").read_text()
    # the README's docker command mounts deploy/grafana (holding radixserve.json) at that path
    assert f'deploy/grafana:{provider["options"]["path"]}:ro"' in readme
