"""PolicyRequestRouter: the routing policy plugged into Ray Serve as the engine deployment's
request router (`RequestRouterConfig(request_router_class=...)`, see cluster/app.py).

Serve builds one inside every handle to the engine deployment, i.e. in every ingress replica,
and keeps doing what it does well: discovering replicas (autoscaling, replacements), dropping
dead ones, probing queue lengths, retrying a request whose replica refused or died before
accepting it. This class only answers "which replica" from the policy, and keeps the policy's
in-flight counts and prefix tree in step with where requests really went:

- `choose_replicas`: `generate` and `reserve` calls carry a `GenerateRequest` dict; its token ids and cache
  namespace (the tenant) go to the policy, which records the dispatch right away (a burst of one new prefix then stays together).
  The first rank is the policy's choice, the second the others by load (used only if the first
  is full). Control calls (`model_card`, ...) go to the least loaded.
- `on_request_routed` (the replica accepted): confirms the record, or moves it.
- `on_request_completed` (the stream ended, however): the policy records the completion.
- `update_replicas` / `on_replica_actor_died`: removed replicas leave the policy.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from radixserve.router.routing.policy import PolicyConfig
from radixserve.router.routing.prefix_tree import Namespace
from radixserve.router.routing.routing_state import RoutingState, routing_state
from radixserve.workers.protocol import LoRARef

logger = logging.getLogger(__name__)

# The calls that carry a GenerateRequest: `generate` (unified and prefill replicas) and
# `reserve` (decode replicas in PD mode).
ROUTED_METHODS = ("generate", "reserve")
REQUEST_ROUTER_CLASS = "radixserve.router.routing.request_router:PolicyRequestRouter"


def state_key(app_name: str, deployment_name: str) -> str:
    return f"{app_name}/{deployment_name}"


class Prompt(NamedTuple):
    namespace: Namespace
    token_ids: list[int]


def routed_prompt(pending_request: PendingRequest | None) -> Prompt | None:
    """The cache namespace and prompt token ids of a `generate` call, None for any other call."""
    if pending_request is None or pending_request.metadata.call_method not in ROUTED_METHODS:
        return None
    args = pending_request.args
    request = args[0] if args else pending_request.kwargs.get("request")
    if not isinstance(request, dict):
        return None
    ids = request.get("input_ids")
    if not isinstance(ids, list) or not ids:
        return None
    namespace = request.get("namespace")
    namespace = namespace if isinstance(namespace, str) else None
    try:
        lora = LoRARef.from_dict(request.get("lora"))
    except ValueError:  # the replica refuses it; its prompt is routed as the base model's
        lora = None
    # An adapter's prompts are cached in a namespace of their own (the engine's, LoRARef.namespace).
    return Prompt(namespace if lora is None else lora.namespace(namespace), ids)


class PolicyRequestRouter(RequestRouter):
    def initialize_state(self, **policy_kwargs: Any) -> None:
        """`policy_kwargs` are PolicyConfig fields (RequestRouterConfig.request_router_kwargs)."""
        key = state_key(self._deployment_id.app_name, self._deployment_id.name)
        self.state: RoutingState = routing_state(key, PolicyConfig(**policy_kwargs))

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None:
            # Asked again only when every rank was full: wait before the next round.
            pending_request.routing_context.should_backoff = True
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        loads = self.state.loads(list(by_id))
        ranked = [by_id[x.replica_id] for x in sorted(loads, key=lambda x: (x.load, x.replica_id))]
        prompt = routed_prompt(pending_request)
        if prompt is None or pending_request is None:
            return [ranked]
        request_id = pending_request.metadata.internal_request_id
        chosen = self.state.route(request_id, prompt.token_ids, list(by_id), prompt.namespace).replica_id
        return [[by_id[chosen]], [r for r in ranked if r.replica_id.unique_id != chosen]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        prompt = routed_prompt(pending_request)
        if prompt is not None:
            request_id = pending_request.metadata.internal_request_id
            self.state.on_dispatch(request_id, prompt.token_ids, replica_id.unique_id, prompt.namespace)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.state.on_complete(internal_request_id, replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.state.set_replicas(r.replica_id.unique_id for r in replicas)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        logger.warning("engine replica %s died; it leaves the routing policy", replica_id.unique_id)
        self.state.remove_replica(replica_id.unique_id)
