"""deploy/: the `ray up` configs pass Ray's own cluster-config schema (as `ray up` fills them in),
serve.yaml passes Serve's schema and our argument check, prometheus.yml passes `promtool check
config`, and the alert rules pass their `promtool test rules` cases. No Ray cluster is started."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from radixserve.cluster.config import ServerArgs

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"


def load(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


def validated(config: dict) -> dict:
    """What `ray up` checks: the provider's defaults filled in, then Ray's JSON schema and rules."""
    full = prepare_config(copy.deepcopy(config))
    validate_config(full)
    return full


@pytest.fixture(scope="module")
def promtool() -> str:
    """promtool from Debian's prometheus package, installed if missing."""
    if shutil.which("promtool") is None:
        if shutil.which("apt-get") is None:
            pytest.skip("promtool is not installed and apt-get is unavailable to install it")
        subprocess.run(["bash", str(DEPLOY / "apt-install.sh"), "prometheus"], check=True, timeout=600)
    path = shutil.which("promtool")
    assert path, "deploy/apt-install.sh prometheus did not install promtool"
    return path


@pytest.mark.parametrize("name", ["cluster.yaml", "cluster-aws.yaml"])
def test_cluster_configs_pass_rays_schema(name):
    full = validated(load(name))
    assert full["head_node_type"] in full["available_node_types"]


def test_rays_schema_rejects_a_broken_config():
    config = load("cluster.yaml")
    config["auth"]["ssh_port"] = 2222  # not a field of Ray's `auth`
    with pytest.raises(jsonschema.ValidationError, match="ssh_port"):
        validated(config)
    config = load("cluster-aws.yaml")
    config["max_workers"] = 1  # below the pools' min_workers (1 + 1)
    with pytest.raises(ValueError, match="max_workers"):
        validated(config)


def test_local_cluster_keeps_every_worker_ip():
    full = validated(load("cluster.yaml"))
    ((_, node_type),) = full["available_node_types"].items()
    n = len(full["provider"]["worker_ips"])
    assert node_type["min_workers"] == node_type["max_workers"] == full["max_workers"] == n


def test_aws_cluster_has_a_cpu_head_and_gpu_pools_the_autoscaler_can_grow():
    full = validated(load("cluster-aws.yaml"))
    types = full["available_node_types"]
    assert set(types) == {"head", "prefill_gpu", "decode_gpu"}
    assert "GPU" not in types["head"]["resources"]
    for pool in ("prefill", "decode"):
        t = types[f"{pool}_gpu"]
        assert t["resources"]["GPU"] >= 1 and t["resources"][f"{pool}_pool"] == 1
        assert 0 <= t["min_workers"] < t["max_workers"] <= full["max_workers"]
    assert sum(t.get("min_workers", 0) for t in types.values()) <= full["max_workers"]
    assert full["idle_timeout_minutes"] > 0  # nodes idle after a Serve scale-down go away


@pytest.mark.parametrize("name", ["cluster.yaml", "cluster-aws.yaml"])
def test_cluster_runs_with_token_auth_and_private_ports(name):
    config = load(name)
    setup = "\n".join(config["setup_commands"])
    assert "RAY_AUTH_MODE=token" in setup and ">> ~/.bashrc" in setup
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    assert "-c ~/radixserve/requirements/constraints.txt" in setup
    (head_start,) = [c for c in config["head_start_ray_commands"] if c.startswith("ray start")]
    assert "--dashboard-host=127.0.0.1" in head_start and "--metrics-export-port=8080" in head_start
    (worker_start,) = [c for c in config["worker_start_ray_commands"] if c.startswith("ray start")]
    assert "--metrics-export-port=8080" in worker_start


def test_serve_yaml_passes_serves_schema_and_our_arguments():
    from ray.serve.schema import ServeDeploySchema

    config = load("serve.yaml")
    schema = ServeDeploySchema.model_validate(config)
    (app,) = schema.applications
    assert app.import_path == "radixserve.cluster.app:build_app"
    args = ServerArgs.from_dict(app.args)
    assert args.http.port == config["http_options"]["port"]
    assert config["http_options"]["host"] == "127.0.0.1"
    # The per-deployment options name deployments the app really has.
    from radixserve.router.frontend.ingress import IngressDeployment
    from radixserve.workers.replica import EngineReplica

    overrides = {d.name: d for d in app.deployments}
    assert set(overrides) == {EngineReplica.name, IngressDeployment.name}
    assert overrides[EngineReplica.name].graceful_shutdown_timeout_s >= 60


def test_serve_pd_yaml_passes_serves_schema_and_builds_three_deployments():
    from ray.serve.schema import ServeDeploySchema

    from radixserve.cluster.app import ROLE_DEPLOYMENTS, build
    from radixserve.router.frontend.ingress import IngressDeployment

    config = load("serve-pd.yaml")
    schema = ServeDeploySchema.model_validate(config)
    (app,) = schema.applications
    assert app.import_path == "radixserve.cluster.app:build_app"
    args = ServerArgs.from_dict(app.args)
    assert args.deployment.pd and args.deployment.pd_on_failure == "recompute"
    assert args.http.port == config["http_options"]["port"]
    overrides = {d.name: d for d in app.deployments}
    roles = {ROLE_DEPLOYMENTS["prefill"], ROLE_DEPLOYMENTS["decode"]}
    assert set(overrides) == roles | {IngressDeployment.name}
    # The built application has exactly these deployments, each engine pool with its role.
    built = build(args)._bound_deployment
    assert built.name == IngressDeployment.name
    engines = [a._bound_deployment for a in built.init_args if hasattr(a, "_bound_deployment")]
    assert {e.name: e.init_args[0].role for e in engines} == {
        "PrefillReplica": "prefill",
        "DecodeReplica": "decode",
    }
    assert {e.name: e.ray_actor_options["num_cpus"] for e in engines} == {
        "PrefillReplica": 1,
        "DecodeReplica": 1,
    }


def test_promtool_checks_the_prometheus_config(promtool):
    # README: promtool check config deploy/prometheus.yml
    out = subprocess.run(
        [promtool, "check", "config", str(DEPLOY / "prometheus.yml")], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 6 rules found" in out.stdout + out.stderr  # rule_files reaches alerts.yml


def test_alert_rules_pass_their_promtool_tests(promtool):
    # README: promtool test rules deploy/alerts_test.yml
    out = subprocess.run(
        [promtool, "test", "rules", str(DEPLOY / "alerts_test.yml")], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
    tests = yaml.safe_load((DEPLOY / "alerts_test.yml").read_text())["tests"]
    rules = [r["alert"] for g in load("alerts.yml")["groups"] for r in g["rules"]]
    fired = {t["alertname"] for case in tests for t in case["alert_rule_test"] if t["exp_alerts"]}
    assert fired == set(rules)  # every rule has a case where it fires


def test_alert_rule_tests_fail_when_a_rule_changes(promtool, tmp_path):
    shutil.copy(DEPLOY / "alerts_test.yml", tmp_path)
    rules = (
        (DEPLOY / "alerts.yml")
        .read_text()
        .replace("radixserve:token_usage) > 0.95", "radixserve:token_usage) > 0.99")
    )
    (tmp_path / "alerts.yml").write_text(rules)
    out = subprocess.run(
        [promtool, "test", "rules", str(tmp_path / "alerts_test.yml")], capture_output=True, text=True
    )
    assert out.returncode != 0 and "RadixServeKVPoolExhausted" in out.stdout + out.stderr


def test_radixserve_serve_starts_its_own_loopback_ray_or_joins_the_given_one(monkeypatch):
    from ray._private import ray_constants

    from radixserve.cluster import cli
    from radixserve.cluster.config import parse_cli

    args = parse_cli(["--ray-metrics-export-port", "8080", "--log-level", "warning"])
    own = cli.ray_init_kwargs(args, None)
    # "local": a new instance, even where another one is recorded as this machine's current cluster
    assert own == {
        "address": "local",
        "include_dashboard": False,
        "logging_level": "WARNING",
        "configure_logging": True,
        "_metrics_export_port": 8080,
    }
    joined = cli.ray_init_kwargs(args, "10.0.0.1:6379")
    assert joined["address"] == "10.0.0.1:6379" and "_metrics_export_port" not in joined

    monkeypatch.delenv(cli.AUTH_MODE_ENV, raising=False)
    monkeypatch.setenv(cli.SINGLE_MACHINE_ENV, "1")
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    cli._loopback_only()
    assert ray_constants.ENABLE_RAY_CLUSTER is False  # this process already imported Ray
    assert (os.environ[cli.SINGLE_MACHINE_ENV], os.environ[cli.AUTH_MODE_ENV]) == ("0", "token")
    monkeypatch.setenv(cli.AUTH_MODE_ENV, "disabled")  # the user's explicit choice stays
    cli._loopback_only()
    assert os.environ[cli.AUTH_MODE_ENV] == "disabled"
    with pytest.raises(SystemExit):
        parse_cli(["--ray-metrics-export-port", "0"])
