"""deploy/: the `ray up` configs pass Ray's own cluster-config schema (as `ray up` fills them in),
serve.yaml passes Serve's schema and our argument check, prometheus.yml passes `promtool check
config`, and the alert rules pass their `promtool test rules` cases. No Ray cluster is started."""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from radixserve.cluster.config import ServerArgs
from radixserve.router.frontend.config import HTTPConfig
from radixserve.router.frontend.proxy import transport_environment

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


def ray_start(commands: list[str]) -> str:
    """The one `ray start` of a node's start commands (after any VAR=value settings)."""
    (start,) = [c for c in commands if re.match(r"(\w+=\S*\s+)*ray start ", c)]
    return start


def test_local_cluster_keeps_every_worker_ip():
    full = validated(load("cluster.yaml"))
    ((_, node_type),) = full["available_node_types"].items()
    n = len(full["provider"]["worker_ips"])
    assert node_type["min_workers"] == node_type["max_workers"] == full["max_workers"] == n
    # The head's autoscaler sets the workers up: v1, since v2 never launches a local provider's.
    head_start = ray_start(full["head_start_ray_commands"])
    assert head_start.startswith("RAY_enable_autoscaler_v2=0 ") and " ray start --head " in head_start


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


DLAMI = (
    "resolve:ssm:/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id"
)


def test_aws_gpu_nodes_boot_the_deep_learning_ami_with_the_nvidia_driver():
    types = validated(load("cluster-aws.yaml"))["available_node_types"]
    assert {t: types[t]["node_config"]["ImageId"] for t in ("prefill_gpu", "decode_gpu")} == {
        "prefill_gpu": DLAMI,
        "decode_gpu": DLAMI,
    }
    assert types["head"]["node_config"]["ImageId"].startswith("ami-")  # no GPU: plain Ubuntu


def engine_deployments(config: dict) -> dict:
    """The engine deployments that a serve config's application builds, by name."""
    from ray.serve.schema import ServeDeploySchema

    from radixserve.cluster.app import build

    (app,) = ServeDeploySchema.model_validate(config).applications
    built = build(ServerArgs.from_dict(app.args))._bound_deployment
    engines = [a._bound_deployment for a in built.init_args if hasattr(a, "_bound_deployment")]
    return {e.name: e for e in engines}


def test_serve_pd_pools_ask_for_the_resources_their_aws_node_types_advertise():
    types = validated(load("cluster-aws.yaml"))["available_node_types"]
    builtin = {"CPU", "GPU", "memory", "object_store_memory"}
    advertised = {t: set(types[t]["resources"]) - builtin for t in types}
    engines = engine_deployments(load("serve-pd.yaml"))
    requested = {name: e.ray_actor_options.get("resources", {}) for name, e in engines.items()}
    assert requested == {"PrefillReplica": {"prefill_pool": 0.01}, "DecodeReplica": {"decode_pool": 0.01}}
    # Every custom resource a node type advertises is asked for, and each pool's only by its type.
    assert set().union(*advertised.values()) == set().union(*map(set, requested.values()))
    for name, node_type in (("PrefillReplica", "prefill_gpu"), ("DecodeReplica", "decode_gpu")):
        hosts = [t for t, names in advertised.items() if set(requested[name]) <= names]
        assert hosts == [node_type]
        assert all(amount <= types[node_type]["resources"][r] for r, amount in requested[name].items())


# A commented `args` line of the autoscaling example in deploy/serve.yaml.
AUTOSCALE_EXAMPLE = re.compile(r"^(\s+)# ((?:min_replicas|max_replicas|autoscale_\w+): \S+)")


def test_serve_yaml_autoscaling_example_tunes_the_llm_aware_policy():
    """Uncommented, serve.yaml's autoscaling example (in `args`) autoscales the engine replicas
    with LoadPolicy at the targets it names. Its `deployments:` section offers no Serve
    autoscaling_config: there Serve would replace the whole policy with its default one, as its
    own override of the same deployment shows."""
    from ray.serve._private.application_state import override_deployment_info
    from ray.serve._private.deployment_info import DeploymentInfo
    from ray.serve.schema import ServeApplicationSchema

    from radixserve.cluster.autoscaling import POLICY_PATH

    text = (DEPLOY / "serve.yaml").read_text()
    lines = [AUTOSCALE_EXAMPLE.sub(r"\1\2", line) for line in text.splitlines()]
    assert sum(a != b for a, b in zip(lines, text.splitlines())) == 9
    config = yaml.safe_load("\n".join(lines))
    engine = engine_deployments(config)["EngineReplica"]
    autoscaling = engine._deployment_config.autoscaling_config
    assert (autoscaling.min_replicas, autoscaling.max_replicas, autoscaling.initial_replicas) == (1, 4, 1)
    assert autoscaling.policy.policy_function == POLICY_PATH
    assert autoscaling.policy.policy_kwargs == {
        "role": "unified",
        "queued_prompt_tokens": 8192.0,
        "kv_usage": 0.8,
        "running_sequences": 48.0,
        "upscale_delay_s": 30.0,
        "downscale_delay_s": 600.0,
        "ttft_s": 2.0,
        "itl_s": 0.1,
    }
    deployments = text.split("\n    deployments:\n", 1)[1]
    serve_keys = re.compile(r"^\s*#?\s*(autoscaling_config:|num_replicas: auto)", re.MULTILINE)
    assert serve_keys.findall(deployments) == []
    # What Serve does with one there: its default policy, on ongoing requests, instead of ours.
    info = DeploymentInfo(
        deployment_config=engine._deployment_config,
        replica_config=engine._replica_config,
        start_time_ms=0,
        deployer_job_id="job",
    )
    (app,) = config["applications"]
    serve_autoscaling = {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 16}
    for override in (
        {"num_replicas": "auto", "autoscaling_config": serve_autoscaling},
        {"autoscaling_config": serve_autoscaling},
    ):
        schema = ServeApplicationSchema.model_validate(
            {**app, "deployments": [{"name": "EngineReplica", **override}]}
        )
        replaced = override_deployment_info({"EngineReplica": info}, schema)["EngineReplica"]
        policy = replaced.deployment_config.autoscaling_config.policy
        assert policy.policy_function == "ray.serve.autoscaling_policy:default_autoscaling_policy"


@pytest.mark.parametrize("name", ["cluster.yaml", "cluster-aws.yaml"])
def test_cluster_runs_with_token_auth_and_private_ports(name):
    config = load(name)
    setup = "\n".join(config["setup_commands"])
    assert "RAY_AUTH_MODE=token" in setup and ">> ~/.bashrc" in setup
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    assert "-c ~/radixserve/requirements/constraints.txt" in setup
    head_start = ray_start(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head_start and "--metrics-export-port=8080" in head_start
    worker_start = ray_start(config["worker_start_ray_commands"])
    assert "--metrics-export-port=8080" in worker_start
    # Ray's workers (the engine replicas) at nice 0, not Ray's default 15 (cluster/cli.py)
    assert all("RAY_worker_niceness=0 " in start for start in (head_start, worker_start))
    # Serve's transport as `radixserve serve` sets it, for the default HTTP limits (proxy.py)
    for var, value in transport_environment(HTTPConfig(), {}).items():
        assert all(f" {var}={value} " in f" {start}" for start in (head_start, worker_start)), var


@pytest.mark.parametrize("wheel_dir", [None, "/srv/wheels dir"])
def test_local_cluster_install_takes_only_radixserve_wheel_dir_as_a_local_source(wheel_dir):
    """The node's pip install, as its login shell expands it: the public index plus
    `--find-links $RADIXSERVE_WHEEL_DIR` where the node sets that variable, and nothing else."""
    (install,) = [c for c in load("cluster.yaml")["setup_commands"] if "-e ~/radixserve" in c]
    prefix = "~/radixserve-venv/bin/python -m pip install "
    assert install.startswith(prefix)
    env = {"PATH": os.environ["PATH"], "HOME": "/home/node"}
    if wheel_dir is not None:
        env["RADIXSERVE_WHEEL_DIR"] = wheel_dir
    out = subprocess.run(
        ["bash", "-c", "printf '%s\\n' " + install[len(prefix) :]],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    links = ["--find-links", wheel_dir] if wheel_dir is not None else []
    assert out.stdout.splitlines() == [
        "-q",
        "-c",
        "/home/node/radixserve/requirements/constraints.txt",
        *links,
        "-e",
        "/home/node/radixserve",
    ]


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


def test_the_cli_module_leaves_ray_unimported():
    """`radixserve serve` sets Ray's environment (auth mode, node IP, Serve's transport) before Ray
    is imported: Ray reads it at import, and a driver that read "disabled" cannot reach its own
    token-authenticated GCS."""
    code = "import sys, radixserve.cluster.cli; print(sorted(m for m in sys.modules if m.split('.')[0] == 'ray'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


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
    monkeypatch.delenv(cli.WORKER_NICENESS_ENV, raising=False)
    monkeypatch.setenv(cli.SINGLE_MACHINE_ENV, "1")
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    cli._loopback_only()
    assert ray_constants.ENABLE_RAY_CLUSTER is False  # this process already imported Ray
    assert (os.environ[cli.SINGLE_MACHINE_ENV], os.environ[cli.AUTH_MODE_ENV]) == ("0", "token")
    assert os.environ[cli.WORKER_NICENESS_ENV] == "0"  # the engine at the machine's priority
    monkeypatch.setenv(cli.AUTH_MODE_ENV, "disabled")  # the user's explicit choice stays
    monkeypatch.setenv(cli.WORKER_NICENESS_ENV, "5")
    cli._loopback_only()
    assert os.environ[cli.AUTH_MODE_ENV] == "disabled" and os.environ[cli.WORKER_NICENESS_ENV] == "5"
    with pytest.raises(SystemExit):
        parse_cli(["--ray-metrics-export-port", "0"])
