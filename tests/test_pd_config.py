"""`radixserve serve --pd ...`: the flags, their config fields and the deployments they build."""

from __future__ import annotations

import pytest

from radixserve.cluster.app import replica_options
from radixserve.cluster.config import ServerArgs, parse_cli


def test_pd_flags_are_config_fields():
    args = parse_cli(
        [
            "--pd",
            "--prefill-replicas",
            "2",
            "--decode-replicas",
            "3",
            "--prefill-num-cpus",
            "1.5",
            "--decode-num-cpus",
            "0.5",
            "--kv-transfer",
            "ray",
            "--pd-on-failure",
            "error",
            "--pd-local-prefill-tokens",
            "128",
        ]
    )
    d = args.deployment
    assert (d.pd, d.prefill_replicas, d.decode_replicas) == (True, 2, 3)
    assert d.pd_local_prefill_tokens == args.ingress_config().pd_local_prefill_tokens == 128
    assert (d.prefill_num_cpus, d.decode_num_cpus, d.pd_on_failure) == (1.5, 0.5, "error")
    assert args.engine.kv_transfer == "ray" and args.engine.role == "unified"
    flat = args.to_dict()
    assert "role" not in flat and ServerArgs.from_dict(flat) == args  # the YAML / build_app form


@pytest.mark.parametrize(
    "argv",
    [
        ["--kv-transfer", "tcp"],
        ["--pd-on-failure", "retry"],
        ["--role", "prefill"],
        ["--prefill-replicas", "0"],
        ["--pd-local-prefill-tokens", "-1"],
        ["--pd", "--prefill-tp", "0"],
        ["--prefill-tp", "2"],  # a PD setting: --tp without --pd
    ],
)
def test_bad_pd_flags_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        parse_cli(argv)


def test_role_is_not_a_user_setting():
    with pytest.raises(ValueError, match="unknown server argument"):
        ServerArgs.from_dict({"role": "decode"})
    with pytest.raises(ValueError, match="unknown server argument"):
        ServerArgs.from_dict({"kv_peer_tp_size": 2})  # set from --prefill-tp


def test_each_pool_gets_its_name_replicas_cpus_and_policy():
    args = ServerArgs.from_dict(
        {"pd": True, "prefill_replicas": 2, "decode_replicas": 1, "prefill_num_cpus": 2, "decode_num_cpus": 1}
    )
    p, d = replica_options(args, "prefill"), replica_options(args, "decode")
    assert (p["name"], p["num_replicas"], p["ray_actor_options"]) == ("PrefillReplica", 2, {"num_cpus": 2})
    assert (d["name"], d["num_replicas"], d["ray_actor_options"]) == ("DecodeReplica", 1, {"num_cpus": 1})
    # Prefill by prefix affinity once there is a choice; decode by KV room, held turns and load.
    assert p["request_router_config"].request_router_kwargs["policy"] == "cache_aware"
    assert d["request_router_config"].request_router_kwargs["policy"] == "kv_aware"
    ingress = args.ingress_config()
    assert ingress.policy.policy == "cache_aware" and ingress.decode_policy.policy == "kv_aware"
    assert ingress.pd_on_failure == "recompute"
    # Each pool autoscales on its own bounds.
    scaled = ServerArgs.from_dict({"pd": True, "decode_min_replicas": 1, "decode_max_replicas": 3})
    assert "autoscaling_config" in replica_options(scaled, "decode")
    assert "autoscaling_config" not in replica_options(scaled, "prefill")


def test_pd_with_tensor_parallel_replicas_gives_both_pools_a_group_per_replica():
    """Both pools take --tp: each replica of either is a placement group of one bundle per rank
    (each rank moves its own heads' KV to the same rank of the peer, workers/executor/tp_kv.py)."""
    args = ServerArgs.from_dict({"pd": True, "tp": 3, "prefill_num_cpus": 1, "decode_num_cpus": 2})
    assert args.engine.tp_size == 3
    for role, cpus in (("prefill", 1), ("decode", 2)):
        options = replica_options(args, role)
        assert options["placement_group_bundles"] == [{"CPU": cpus}] * 3
        assert options["placement_group_strategy"] == "STRICT_PACK"


def test_each_pool_takes_its_own_degree():
    """--prefill-tp and --decode-tp: a placement group per replica at the pool's own degree, and
    the decode engines plan their receives for the prefill pool's."""
    args = parse_cli(["--pd", "--prefill-tp", "3", "--decode-tp", "1", "--prefill-num-cpus", "1"])
    assert (args.tp_of("prefill"), args.tp_of("decode"), args.tp_of("unified")) == (3, 1, 1)
    prefill, decode = args.role_engine("prefill"), args.role_engine("decode")
    assert (prefill.role, prefill.tp_size, prefill.kv_peer_tp_size) == ("prefill", 3, 0)
    assert (decode.role, decode.tp_size, decode.kv_peer_tp_size) == ("decode", 1, 3)
    options = replica_options(args, "prefill")
    assert options["placement_group_bundles"] == [{"CPU": 1}] * 3
    assert "placement_group_bundles" not in replica_options(args, "decode")
    assert ServerArgs.from_dict(args.to_dict()) == args
    # One of them set: the other pool keeps --tp.
    args = ServerArgs.from_dict({"pd": True, "tp": 3, "decode_tp": 1})
    assert (args.tp_of("prefill"), args.role_engine("decode").kv_peer_tp_size) == (3, 3)


def test_each_pool_asks_for_its_custom_resources_replica_and_ranks():
    """--prefill-resources / --decode-resources (JSON on the command line, a mapping in YAML):
    the pool's replicas ask Ray for them, each rank's bundle too, so a pool lands only on the
    nodes that advertise them."""
    args = parse_cli(
        ["--pd", "--prefill-resources", '{"prefill_pool": 0.01}', "--decode-resources", '{"decode_pool": 1}']
        + ["--prefill-num-cpus", "2", "--decode-num-cpus", "1", "--decode-tp", "2"]
    )
    assert args.deployment.prefill_resources == {"prefill_pool": 0.01}
    assert ServerArgs.from_dict(args.to_dict()) == args
    p, d = replica_options(args, "prefill"), replica_options(args, "decode")
    assert p["ray_actor_options"] == {"num_cpus": 2, "resources": {"prefill_pool": 0.01}}
    assert "placement_group_bundles" not in p
    assert d["ray_actor_options"] == {"num_cpus": 1, "resources": {"decode_pool": 1}}
    assert d["placement_group_bundles"] == [{"CPU": 1, "decode_pool": 1}] * 2
    plain = replica_options(ServerArgs.from_dict({"pd": True, "prefill_num_cpus": 1}), "prefill")
    assert plain["ray_actor_options"] == {"num_cpus": 1}


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"prefill_resources": {"prefill_pool": 1}}, "PD settings"),  # without --pd
        ({"pd": True, "decode_resources": {"GPU": 1}}, "not a custom resource"),
        ({"pd": True, "decode_resources": {"decode_pool": 0}}, "must be a number > 0"),
        ({"pd": True, "prefill_resources": {"prefill_pool": "a"}}, "must be a number > 0"),
        ({"pd": True, "prefill_resources": {}}, "non-empty mapping"),
        ({"pd": True, "prefill_resources": "prefill_pool"}, "non-empty mapping"),
    ],
)
def test_bad_pool_resources_are_refused(given, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs.from_dict(given)


def test_pool_resources_on_the_command_line_are_json(capsys):
    with pytest.raises(SystemExit):
        parse_cli(["--pd", "--prefill-resources", "prefill_pool=1"])
    assert "--prefill-resources" in capsys.readouterr().err
