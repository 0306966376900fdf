"""`--tp` / `--ep` / `--tp-placement`: parsed into the engine and deployment layers, and turned into
the engine deployment's placement group (one bundle per rank) that Serve accepts. No Ray started."""

from __future__ import annotations

import pytest
import torch

from radixserve.cluster import app
from radixserve.cluster.config import ServerArgs, parse_cli


def test_the_flags_and_their_aliases():
    a = parse_cli(["--tp", "4", "--ep", "2", "--tp-placement", "pack"])
    assert (a.engine.tp_size, a.engine.ep_size, a.deployment.tp_placement) == (4, 2, "pack")
    a = parse_cli(["--tp-size", "2"])
    assert (a.engine.tp_size, a.engine.ep_size, a.deployment.tp_placement) == (2, 1, "strict_pack")
    assert ServerArgs.from_dict({"tp": 3, "ep": 3}).engine.parallel.moe_tp_size == 1
    with pytest.raises(SystemExit):
        parse_cli(["--tp-placement", "spread"])
    with pytest.raises(ValueError, match="tp_placement must be one of"):
        ServerArgs.from_dict({"tp_placement": "spread"})
    with pytest.raises(ValueError, match=r"ep_size \(3\) must divide tp_size \(4\)"):
        ServerArgs.from_dict({"tp": 4, "ep": 3})


def test_a_tp_replica_is_a_placement_group_of_one_bundle_per_rank(monkeypatch):
    from radixserve.workers.replica import EngineReplica

    opts = app.replica_options(ServerArgs.from_dict({"tp": 2, "replica_num_cpus": 1.5}))
    assert opts["ray_actor_options"] == {"num_cpus": 1.5}  # rank 0 fits bundle 0
    assert opts["placement_group_bundles"] == [{"CPU": 1.5}, {"CPU": 1.5}]
    assert opts["placement_group_strategy"] == "STRICT_PACK"
    config = EngineReplica.options(**opts)._deployment_config  # Serve's own checks of the options
    assert config is not None
    packed = app.replica_options(ServerArgs.from_dict({"tp": 2, "tp_placement": "pack"}))
    assert packed["placement_group_strategy"] == "PACK"
    assert "placement_group_bundles" not in app.replica_options(ServerArgs.from_dict({}))
    # Without --replica-num-cpus each node's CPUs are split among the ranks it holds.
    monkeypatch.setattr(app.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(app.os, "cpu_count", lambda: 8)
    assert [app.replica_cpu_share(dp, 2) for dp in (1, 2, 3)] == [4.0, 2.0, 1.0]
    assert app.replica_cpu_share(1, 4) == 2.0


def test_cuda_replicas_ask_ray_for_one_gpu_per_rank(monkeypatch):
    """--device cuda: a replica (rank 0) and each rank's bundle hold one GPU; auto resolves on the
    cluster's resources, and cuda on a cluster without GPUs is refused before anything deploys."""
    from radixserve.workers.replica import EngineReplica

    def device_on(gpus: float | None, device: str, **more) -> ServerArgs:
        monkeypatch.setattr(app, "cluster_gpus", lambda: gpus)
        return app.with_engine_device(ServerArgs.from_dict({"device": device, **more}))

    assert device_on(8.0, "auto").engine.device == "cuda"
    assert device_on(0.0, "auto").engine.device == "cpu"
    assert device_on(None, "auto").engine.device == "cpu"  # GPUs unknown: nothing to place on them
    assert device_on(None, "cuda").engine.device == "cuda"  # taken as given
    assert device_on(8.0, "cpu").engine.device == "cpu"
    monkeypatch.undo()
    monkeypatch.setattr(app.ray, "is_initialized", lambda: False)
    if not torch.cuda.is_available():  # before Ray is up, this machine's GPUs count (none here)
        assert app.cluster_gpus() is None
    with pytest.raises(ValueError, match="--device cuda, but the Ray cluster has no GPU"):
        device_on(0.0, "cuda")

    one = app.replica_options(device_on(8.0, "cuda", replica_num_cpus=4))
    assert one["ray_actor_options"] == {"num_cpus": 4.0, "num_gpus": 1}
    assert "placement_group_bundles" not in one
    tp = app.replica_options(device_on(8.0, "cuda", tp=2, replica_num_cpus=4))
    assert tp["ray_actor_options"] == {"num_cpus": 4.0, "num_gpus": 1}  # rank 0 fits bundle 0
    assert tp["placement_group_bundles"] == [{"CPU": 4.0, "GPU": 1}, {"CPU": 4.0, "GPU": 1}]
    assert EngineReplica.options(**tp)._deployment_config is not None
    for role in ("prefill", "decode"):
        pd = app.replica_options(device_on(8.0, "auto", pd=True, prefill_num_cpus=2, decode_num_cpus=2), role)
        assert pd["ray_actor_options"] == {"num_cpus": 2.0, "num_gpus": 1}
