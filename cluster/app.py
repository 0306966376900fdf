"""Assemble the Ray Serve application from server arguments.

`build_app` is the import path Ray Serve's own tooling calls (`serve run deploy/serve.yaml`,
`radixserve.cluster.app:build_app`): it takes the flat argument dict of the YAML's `args:` and
returns the bound application: the ingress in front of `dp` engine replicas.
"""

from __future__ import annotations

from typing import Any, Optional

from ray.serve import Application

from radixserve.cluster.config import ServerArgs
from radixserve.router.ingress import IngressDeployment
from radixserve.workers.replica import EngineReplica


def replica_options(args: ServerArgs) -> dict[str, Any]:
    """Serve options of the engine deployment. The replica-choice policy plugs in here, as a
    Serve request router on this deployment (`router_policy` = "module:RequestRouterClass")."""
    opts: dict[str, Any] = {"num_replicas": args.deployment.dp,
                            "ray_actor_options": {"num_cpus": args.deployment.replica_num_cpus}}
    if args.deployment.router_policy:
        from ray.serve.config import RequestRouterConfig

        opts["request_router_config"] = RequestRouterConfig(
            request_router_class=args.deployment.router_policy)
    return opts


def build(args: ServerArgs) -> Application:
    replicas = EngineReplica.options(**replica_options(args)).bind(args.engine_kwargs())
    ingress = IngressDeployment.options(
        num_replicas=args.deployment.ingress_replicas,
        ray_actor_options={"num_cpus": args.deployment.ingress_num_cpus})
    return ingress.bind(replicas, {**args.to_dict()})


def build_app(args: Optional[dict[str, Any]] = None) -> Application:
    """Ray Serve's application builder: `args` is the flat dict of ServerArgs field names."""
    return build(ServerArgs.from_dict(args))
