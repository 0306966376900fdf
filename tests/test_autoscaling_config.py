"""Autoscaling flags and the Serve deployment options built from them, per engine role."""

from __future__ import annotations

import pytest

from radixserve.cluster.app import replica_options
from radixserve.cluster.autoscaling import POLICY_PATH, deployment_autoscaling
from radixserve.cluster.config import ServerArgs, parse_cli

DRAIN = {"graceful_shutdown_timeout_s": 300.0, "graceful_shutdown_wait_loop_s": 0.5}


def test_flags_and_yaml_set_the_autoscaling_fields(tmp_path):
    args = parse_cli(
        ["--dp", "2", "--min-replicas", "1", "--max-replicas", "3", "--autoscale-upscale-delay-s", "2.5"]
        + ["--prefill-max-replicas", "4", "--decode-min-replicas", "2", "--drain-timeout-s", "60"]
    )
    a = args.autoscale
    assert (a.min_replicas, a.max_replicas, a.autoscale_upscale_delay_s) == (1, 3, 2.5)
    assert (a.prefill_min_replicas, a.prefill_max_replicas) == (1, 4)
    assert (a.decode_min_replicas, a.decode_max_replicas, a.drain_timeout_s) == (2, None, 60.0)
    path = tmp_path / "serve.yaml"
    path.write_text("max_replicas: 2\nautoscale_target_kv_usage: 0.5\n")
    a = ServerArgs.from_yaml(str(path)).autoscale
    assert (a.max_replicas, a.autoscale_target_kv_usage) == (2, 0.5)
    assert ServerArgs.from_dict(ServerArgs.from_yaml(str(path)).to_dict()).autoscale == a


def test_fixed_count_without_autoscaling():
    args = ServerArgs.from_dict({"dp": 2})
    assert deployment_autoscaling("unified", args, 2) == {"num_replicas": 2, **DRAIN}
    # max == min is no range to scale in: the count given stays fixed.
    args = ServerArgs.from_dict({"min_replicas": 2, "max_replicas": 2})
    assert deployment_autoscaling("unified", args, 3) == {"num_replicas": 3, **DRAIN}


def test_unified_autoscaling_options():
    args = ServerArgs.from_dict(
        {
            "dp": 2,
            "max_replicas": 3,
            "max_prefill_tokens": 4096,
            "max_running_requests": 10,
            "autoscale_upscale_delay_s": 2,
            "autoscale_look_back_s": 4,
            "autoscale_metrics_interval_s": 1,
        }
    )
    assert deployment_autoscaling("unified", args, 2) == {
        "autoscaling_config": {
            "min_replicas": 1,
            "max_replicas": 3,
            "initial_replicas": 2,
            "look_back_period_s": 4.0,
            "metrics_interval_s": 1.0,
            "upscale_delay_s": 0.0,  # the policy's own delays are the only ones
            "downscale_delay_s": 0.0,
            "policy": {
                "policy_function": POLICY_PATH,
                "policy_kwargs": {
                    "role": "unified",
                    "queued_prompt_tokens": 4096.0,  # default: --max-prefill-tokens
                    "kv_usage": 0.8,
                    "running_sequences": 8.0,  # default: 3/4 of --max-running-requests
                    "upscale_delay_s": 2.0,
                    "downscale_delay_s": 600.0,
                    "ttft_s": None,  # no latency target: latency is no signal
                    "itl_s": None,
                },
            },
        },
        **DRAIN,
    }


def test_pd_roles_have_their_own_bounds_and_the_initial_count_is_brought_within():
    args = ServerArgs.from_dict(
        {"prefill_min_replicas": 2, "prefill_max_replicas": 4, "autoscale_target_queued_tokens": 512}
    )
    prefill = deployment_autoscaling("prefill", args, 1)["autoscaling_config"]
    assert (prefill["min_replicas"], prefill["max_replicas"], prefill["initial_replicas"]) == (2, 4, 2)
    assert prefill["policy"]["policy_kwargs"]["role"] == "prefill"
    assert prefill["policy"]["policy_kwargs"]["queued_prompt_tokens"] == 512.0
    assert deployment_autoscaling("prefill", args, 9)["autoscaling_config"]["initial_replicas"] == 4
    assert deployment_autoscaling("decode", args, 3) == {"num_replicas": 3, **DRAIN}
    assert deployment_autoscaling("unified", args, 1) == {"num_replicas": 1, **DRAIN}
    with pytest.raises(ValueError, match="role"):
        deployment_autoscaling("mixed", args, 1)


@pytest.mark.parametrize(
    "bad",
    [
        {"max_replicas": 1, "min_replicas": 2},
        {"min_replicas": 0},
        {"decode_min_replicas": 0},
        {"prefill_max_replicas": 1, "prefill_min_replicas": 3},
        {"autoscale_target_kv_usage": 1.5},
        {"autoscale_target_queued_tokens": 0},
        {"autoscale_target_running": 0},
        {"autoscale_downscale_delay_s": -1},
        {"drain_timeout_s": -1},
        {"autoscale_metrics_interval_s": 30},  # not below the 30 s look-back window
        {"autoscale_target_ttft_s": 0},
        {"autoscale_target_itl_s": -0.1},
    ],
)
def test_invalid_autoscaling_settings_are_refused(bad):
    with pytest.raises(ValueError):
        ServerArgs.from_dict(bad)


def test_engine_deployment_options_serve_accepts():
    from ray.serve.config import AutoscalingConfig

    from radixserve.workers.replica import EngineReplica

    args = ServerArgs.from_dict({"max_replicas": 2, "replica_num_cpus": 1})
    opts = replica_options(args)
    assert "num_replicas" not in opts and opts["graceful_shutdown_timeout_s"] == 300.0
    # More than one replica may serve: the router defaults to prefix-aware routing.
    assert opts["request_router_config"].request_router_kwargs["policy"] == "cache_aware"
    deployment = EngineReplica.options(**opts)
    config = deployment._deployment_config
    assert isinstance(config.autoscaling_config, AutoscalingConfig)
    assert config.autoscaling_config.policy.policy_function == POLICY_PATH
    assert (config.graceful_shutdown_timeout_s, config.graceful_shutdown_wait_loop_s) == (300.0, 0.5)
    fixed = EngineReplica.options(**replica_options(ServerArgs.from_dict({"dp": 2, "replica_num_cpus": 1})))
    assert fixed.num_replicas == 2 and fixed._deployment_config.autoscaling_config is None


def test_latency_targets_reach_each_pools_policy():
    args = parse_cli(
        ["--pd", "--prefill-max-replicas", "3", "--decode-max-replicas", "2"]
        + ["--autoscale-target-ttft-s", "1.5", "--autoscale-target-itl-s", "0.05"]
    )
    assert (args.autoscale.autoscale_target_ttft_s, args.autoscale.autoscale_target_itl_s) == (1.5, 0.05)
    for role in ("prefill", "decode"):
        kwargs = deployment_autoscaling(role, args, 1)["autoscaling_config"]["policy"]["policy_kwargs"]
        assert (kwargs["role"], kwargs["ttft_s"], kwargs["itl_s"]) == (role, 1.5, 0.05)
    assert ServerArgs.from_dict(args.to_dict()) == args


def test_the_ingress_counts_its_streams_as_often_as_the_engine_replicas_when_it_stops():
    from radixserve.cluster.app import build

    ingress = build(ServerArgs.from_dict({}))._bound_deployment
    assert ingress.name == "Ingress"
    assert ingress._deployment_config.graceful_shutdown_wait_loop_s == DRAIN["graceful_shutdown_wait_loop_s"]
