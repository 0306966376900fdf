"""Assemble the Ray Serve application from server arguments.

`build_app` is the import path Ray Serve's own tooling calls (`serve run deploy/serve.yaml`,
`radixserve.cluster.app:build_app`): it takes the flat argument dict of the YAML's `args:` and
returns the bound application: the ingress in front of `dp` engine replicas (or between
`min_replicas` and `max_replicas` of them, autoscaled), or with `pd`, in front of a prefill pool
(`PrefillReplica`, routed cache-aware) and a decode pool (`DecodeReplica`, routed by load), each
with its own replica count, CPUs and autoscaling. Each deployment is bound with its typed, frozen
config (an `IngressConfig`, an `EngineConfig` with the deployment's role).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import ray
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from radixserve.cluster.autoscaling import DRAIN_POLL_S, deployment_autoscaling
from radixserve.cluster.config import TP_PLACEMENTS, ServerArgs
from radixserve.router.frontend.ingress import IngressDeployment
from radixserve.router.routing.request_router import REQUEST_ROUTER_CLASS
from radixserve.workers.protocol import Role
from radixserve.workers.replica import EngineReplica

ROLE_DEPLOYMENTS = {
    Role.UNIFIED: "EngineReplica",
    Role.PREFILL: "PrefillReplica",
    Role.DECODE: "DecodeReplica",
}


def replica_options(args: ServerArgs, role: Role = Role.UNIFIED) -> dict[str, Any]:
    """Serve options of the engine deployment of `role`. The routing policy plugs in here, as
    this deployment's Serve request router: every handle to it (one per ingress replica) builds
    its own PolicyRequestRouter with these policy settings."""
    d = args.deployment
    count, cpus, policy, custom = {
        Role.UNIFIED: (d.dp, d.replica_num_cpus, args.policy_kwargs, None),
        Role.PREFILL: (
            d.prefill_replicas,
            d.prefill_num_cpus,
            args.prefill_policy_kwargs,
            d.prefill_resources,
        ),
        Role.DECODE: (d.decode_replicas, d.decode_num_cpus, args.decode_policy_kwargs, d.decode_resources),
    }[role]
    # Serve takes the class as an import path (its field validator imports it); its annotation
    # names only the deserialized form.
    router = RequestRouterConfig(
        request_router_class=REQUEST_ROUTER_CLASS,  # type: ignore[arg-type]
        request_router_kwargs=policy(),
    )
    if cpus is None:
        # Room for the most replicas every pool may scale to, sharing the nodes: each pool's
        # ranks, at the largest degree (the share per rank then fits every pool).
        most = sum(_most_replicas(args, r) for r in _roles(args))
        cpus = replica_cpu_share(most, max(args.tp_of(r) for r in _roles(args)))
    gpu = {"GPU": 1} if args.engine.device == "cuda" else {}  # resolved by with_engine_device
    # A pool's custom resources (its node type's) go with every rank, so that a group spread
    # over nodes (tp_placement pack) stays on the pool's nodes too.
    custom = dict(custom or {})
    rank = {"CPU": cpus, **gpu, **custom}  # one rank's resources; rank 0 is the replica itself
    actor: dict[str, Any] = {"num_cpus": cpus, **({"num_gpus": 1} if gpu else {})}
    if d.replica_memory_gb is not None:
        actor["memory"] = replica_memory_bytes(args)
    if custom:
        actor["resources"] = custom
    return {
        **deployment_autoscaling(role, args, count),
        "name": ROLE_DEPLOYMENTS[role],
        "max_ongoing_requests": d.max_ongoing_requests,
        "ray_actor_options": actor,
        "request_router_config": router,
        **tp_placement(args, rank, args.tp_of(role)),
    }


def tp_placement(args: ServerArgs, rank: dict[str, float], tp: int) -> dict[str, Any]:
    """A tensor-parallel replica is a placement group of one bundle per rank, each of a rank's
    resources (its CPUs, and its GPU on CUDA): Serve puts the replica (rank 0) in bundle 0, and
    the replica starts ranks 1..N-1 in the others (workers/rank_actor.py). Serve reserves the
    group with the replica and frees it with it. One engine per replica at tp_size 1: no group."""
    if tp == 1:
        return {}
    return {
        "placement_group_bundles": [dict(rank) for _ in range(tp)],
        "placement_group_strategy": TP_PLACEMENTS[args.deployment.tp_placement],
    }


def cluster_gpus() -> float | None:
    """GPUs in the Ray cluster now. Where Ray is not initialized yet (`serve run module:builder`
    builds the app before it starts or joins Ray), this machine's: a local Ray will have them;
    None where this machine sees none, since a cluster joined later may still have some."""
    if ray.is_initialized():
        return float(ray.cluster_resources().get("GPU", 0.0))
    import torch

    return float(torch.cuda.device_count()) or None


def with_engine_device(args: ServerArgs) -> ServerArgs:
    """`args` with the engines' device resolved for the cluster: auto is cuda where the cluster
    has GPUs, else cpu, so that every replica asks Ray for the same resources. --device cuda on a
    cluster without GPUs is refused here: its replicas could never be placed. (Unknown GPUs: auto
    is cpu, cuda is taken as given.)"""
    device, gpus = args.engine.device, cluster_gpus()
    if device == "auto":
        device = "cuda" if gpus else "cpu"
    elif device == "cuda" and gpus == 0:
        raise ValueError(
            "--device cuda, but the Ray cluster has no GPU (ray status lists none): start GPU nodes, "
            "or run with --device cpu"
        )
    return dataclasses.replace(args, engine=dataclasses.replace(args.engine, device=device))


def _roles(args: ServerArgs) -> tuple[Role, ...]:
    return (Role.PREFILL, Role.DECODE) if args.deployment.pd else (Role.UNIFIED,)


def _most_replicas(args: ServerArgs, role: Role) -> int:
    d = args.deployment
    bounds = args.autoscale.bounds(role)
    if bounds:
        return bounds[1]
    return {Role.UNIFIED: d.dp, Role.PREFILL: d.prefill_replicas, Role.DECODE: d.decode_replicas}[role]


def replica_cpu_share(dp: int, tp: int = 1) -> float:
    """CPUs per engine replica (per rank of one, with tensor parallelism) when --replica-num-cpus
    is unset: the smallest node's CPUs split among the ranks each node must hold, so all dp
    replicas of tp ranks fit. Ray gives a replica OMP_NUM_THREADS = int(its CPUs) (at least 1),
    which is the engine's torch thread count: one replica on a 2-core machine computes on both
    cores, not on one."""
    node_cpus = []
    if ray.is_initialized():
        node_cpus = [n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n.get("Alive")]
        node_cpus = [c for c in node_cpus if c > 0]
    if not node_cpus:
        node_cpus = [float(os.cpu_count() or 1)]
    per_node = math.ceil(dp / len(node_cpus)) * tp
    share = min(node_cpus) / per_node
    return float(int(share)) if share >= 1 else round(share, 2)


def replica_memory_bytes(args: ServerArgs) -> int | None:
    gb = args.deployment.replica_memory_gb
    return None if gb is None else int(gb * 2**30)


def engine_deployment(args: ServerArgs, role: Role) -> Any:
    """The bound engine deployment of `role`."""
    config = args.role_engine(role)
    options = replica_options(args, role)
    # @serve.deployment turns the class into a Deployment, which mypy cannot see through.
    return EngineReplica.options(**options).bind(config, replica_memory_bytes(args))  # type: ignore[attr-defined]


def build(args: ServerArgs) -> Application:
    args = with_engine_device(args)
    ingress = IngressDeployment.options(
        num_replicas=args.deployment.ingress_replicas,
        max_ongoing_requests=args.deployment.max_ongoing_requests,
        ray_actor_options={"num_cpus": args.deployment.ingress_num_cpus},
        # An ingress that stops (shutdown, update, scale-down) counts its streams in flight as
        # often as the engine replicas do: Serve's 2 s default kept each stop waiting that long.
        graceful_shutdown_wait_loop_s=DRAIN_POLL_S,
    )
    if args.deployment.pd:
        prefill = engine_deployment(args, Role.PREFILL)
        decode = engine_deployment(args, Role.DECODE)
        return ingress.bind(prefill, args.ingress_config(), decode)
    return ingress.bind(engine_deployment(args, Role.UNIFIED), args.ingress_config())


def build_app(args: dict[str, Any] | None = None) -> Application:
    """Ray Serve's application builder: `args` is the flat dict of ServerArgs field names."""
    return build(ServerArgs.from_dict(args))
