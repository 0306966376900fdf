"""Assemble the Ray Serve application from server arguments.

`build_app` is the import path Ray Serve's own tooling calls (`serve run deploy/serve.yaml`,
`radixserve.cluster.app:build_app`): it takes the flat argument dict of the YAML's `args:` and
returns the bound application: the ingress in front of `dp` engine replicas (or between
`min_replicas` and `max_replicas` of them, autoscaled). Each deployment is
bound with its typed, frozen config (an `IngressConfig`, an `EngineConfig`).
"""

from __future__ import annotations

import math
import os
from typing import Any

import ray
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from radixserve.cluster.autoscaling import deployment_autoscaling
from radixserve.cluster.config import TP_PLACEMENTS, ServerArgs
from radixserve.router.frontend.ingress import IngressDeployment
from radixserve.router.routing.request_router import REQUEST_ROUTER_CLASS
from radixserve.workers.replica import EngineReplica


def replica_options(args: ServerArgs) -> dict[str, Any]:
    """Serve options of the engine deployment. The routing policy plugs in here, as this
    deployment's Serve request router: every handle to it (one per ingress replica) builds its
    own PolicyRequestRouter with these policy settings."""
    # Serve takes the class as an import path (its field validator imports it); its annotation
    # names only the deserialized form.
    router = RequestRouterConfig(
        request_router_class=REQUEST_ROUTER_CLASS,  # type: ignore[arg-type]
        request_router_kwargs=args.policy_kwargs(),
    )
    tp = args.engine.tp_size
    cpus = args.deployment.replica_num_cpus
    if cpus is None:
        bounds = args.autoscale.bounds("unified")  # room for the most replicas it may scale to
        cpus = replica_cpu_share(bounds[1] if bounds else args.deployment.dp, tp)
    return {
        **deployment_autoscaling("unified", args, args.deployment.dp),
        "max_ongoing_requests": args.deployment.max_ongoing_requests,
        "ray_actor_options": {"num_cpus": cpus},
        "request_router_config": router,
        **tp_placement(args, cpus),
    }


def tp_placement(args: ServerArgs, cpus: float) -> dict[str, Any]:
    """A tensor-parallel replica is a placement group of one bundle per rank, each of a rank's
    CPUs: Serve puts the replica (rank 0) in bundle 0, and the replica starts ranks 1..N-1 in the
    others (workers/rank_actor.py). Serve reserves the group with the replica and frees it with
    it. One engine per replica at tp_size 1: no group."""
    tp = args.engine.tp_size
    if tp == 1:
        return {}
    return {
        "placement_group_bundles": [{"CPU": cpus} for _ in range(tp)],
        "placement_group_strategy": TP_PLACEMENTS[args.deployment.tp_placement],
    }


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


def build(args: ServerArgs) -> Application:
    # @serve.deployment turns the class into a Deployment, which mypy cannot see through.
    replicas = EngineReplica.options(**replica_options(args)).bind(args.engine)  # type: ignore[attr-defined]
    ingress = IngressDeployment.options(
        num_replicas=args.deployment.ingress_replicas,
        max_ongoing_requests=args.deployment.max_ongoing_requests,
        ray_actor_options={"num_cpus": args.deployment.ingress_num_cpus},
    )
    return ingress.bind(replicas, args.ingress_config())


def build_app(args: dict[str, Any] | None = None) -> Application:
    """Ray Serve's application builder: `args` is the flat dict of ServerArgs field names."""
    return build(ServerArgs.from_dict(args))
