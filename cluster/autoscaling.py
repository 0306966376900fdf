"""Autoscaling the engine deployments on what loads an LLM replica, not on Serve's count of
ongoing requests (to Serve a 10-token question and a 10,000-token document are one request each,
and so are a 5-token answer and a 4,000-token one).

A prefill replica is loaded by the prompt tokens waiting to be prefilled, a decode replica by the
KV cache its sequences hold and by how many sequences it runs, a unified replica by both. Where
latency targets are set, the latency its requests see counts too: a prefill replica's time to
first token, a decode replica's inter-token latency (each replica's own, over its last 30 s:
workers/engine/token_latency.py), each as `latency / target` replicas' worth of load, so a pool
whose mean latency is twice its target asks for twice its replicas. Each replica reports these
as Serve custom metrics (`EngineLoad`, from
`EngineReplica.record_autoscaling_stats`); Serve averages each one per replica over
`look_back_period_s` and calls the deployment's policy every control-loop tick with an
`AutoscalingContext`. `LoadPolicy` turns that context into the plain inputs of `decide`, which
holds all the logic and imports nothing of Ray:

- demand: the replicas the summed load needs at the per-replica targets (`prefill`, `decode`,
  `unified`). The sum runs over the replicas that report: a replica still starting carries no
  load yet, and must not dilute an average.
- up: proportional, straight to ceil(demand) (at most max), once demand has stayed above the
  current count for `upscale_delay_s`. A replica takes long to start (weights, warm-up): stepping
  one at a time behind a burst would pay one start-up per step. Not while replicas of the last
  step are still starting: their share of the load is not visible yet, and counting it again
  would overshoot.
- down: one replica at a time, once demand has stayed at or below (count - 1) * DOWNSCALE_MARGIN
  for `downscale_delay_s`; the timer restarts after each step. A removed replica takes its radix
  cache with it and moves its load onto the others: one step at a time measures the new balance
  before the next. The margin is a hysteresis band: a demand hovering around a whole number of
  replicas moves the count neither way.

Queued prompt tokens measure a backlog, not a rate: they stay near 0 while the replicas keep up.
A prefill deployment whose load lies between n - 1 and n replicas' worth therefore steps down
after `downscale_delay_s` and back up once the backlog returns; the long default delay keeps
that cycle slow. (Running sequences and KV use grow with the load itself and do not cycle so.)

Serve wraps a custom policy in its own delays, scaling factors and bounds
(`ray.serve.autoscaling_policy._apply_autoscaling_config`). `deployment_autoscaling` sets Serve's
delays to 0 and leaves its factors at 1, so these delays are the only ones and the returned count
passes through; Serve's bounds are the same min and max.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from radixserve.workers.protocol import ROLES, EngineLoad, Role

if TYPE_CHECKING:
    from ray.serve.config import AutoscalingContext

    from radixserve.cluster.config import ServerArgs

POLICY_PATH = "radixserve.cluster.autoscaling:LoadPolicy"
DOWNSCALE_MARGIN = 0.8
DRAIN_POLL_S = 0.5  # how often a draining replica counts its requests in flight
# policy_state keys (Serve keeps its own "__decision_*" keys in the same dict).
UP_SINCE, DOWN_SINCE, DEMAND = "radixserve_up_since", "radixserve_down_since", "radixserve_demand"
_EPS = 1e-9  # a demand of exactly 2.0 computed as 2.0000000001 still needs 2 replicas


@dataclass(frozen=True)
class Targets:
    """Per-replica load targets and the delays of a decision."""

    queued_prompt_tokens: float
    kv_usage: float
    running_sequences: float
    upscale_delay_s: float
    downscale_delay_s: float
    # Latency targets (seconds, per replica); None: latency is no signal.
    ttft_s: float | None = None
    itl_s: float | None = None

    def __post_init__(self) -> None:
        latency = [t for t in (self.ttft_s, self.itl_s) if t is not None]
        if min(self.queued_prompt_tokens, self.kv_usage, self.running_sequences, *latency) <= 0:
            raise ValueError("autoscaling targets must be > 0")
        if min(self.upscale_delay_s, self.downscale_delay_s) < 0:
            raise ValueError("autoscaling delays must be >= 0")


def prefill(loads: Sequence[EngineLoad], t: Targets) -> float:
    """Replicas needed for the prompt tokens waiting to be prefilled, or (with a target) for the
    time to first token, whichever needs more."""
    queued = sum(x.queued_prompt_tokens for x in loads) / t.queued_prompt_tokens
    return max(queued, _latency(loads, "ttft_s", t.ttft_s))


def decode(loads: Sequence[EngineLoad], t: Targets) -> float:
    """Replicas needed for the KV held, the sequences running, or (with a target) the
    inter-token latency, whichever needs more."""
    kv = sum(x.kv_usage for x in loads) / t.kv_usage
    running = sum(x.running_sequences for x in loads) / t.running_sequences
    return max(kv, running, _latency(loads, "itl_s", t.itl_s))


def _latency(loads: Sequence[EngineLoad], field: str, target: float | None) -> float:
    """Each replica's latency in targets, summed: n replicas at the target are n replicas' worth."""
    if target is None:
        return 0.0
    return sum(getattr(x, field) for x in loads) / target


def unified(loads: Sequence[EngineLoad], t: Targets) -> float:
    """A unified replica prefills and decodes: the larger of the two demands."""
    return max(prefill(loads, t), decode(loads, t))


DEMAND_OF: dict[Role, Callable[[Sequence[EngineLoad], Targets], float]] = {
    Role.UNIFIED: unified,
    Role.PREFILL: prefill,
    Role.DECODE: decode,
}


@dataclass(frozen=True)
class Replicas:
    """The deployment as the controller sees it."""

    target: int  # the count Serve is converging to (the last decision)
    running: int  # replicas up now (fewer than target while new ones start)
    min: int
    max: int


def decide(
    demand: float | None, replicas: Replicas, t: Targets, now: float, state: Mapping[str, Any]
) -> tuple[int, dict[str, Any]]:
    """The next target replica count and the new policy state (a copy; other keys are kept).

    `demand` is None while no replica reports metrics: the count holds and the timers restart.
    `now` is the controller's clock: the timers in `state` are times on it."""
    new = dict(state)
    current = min(max(replicas.target, replicas.min), replicas.max)
    if current != replicas.target or demand is None:
        new.update({UP_SINCE: None, DOWN_SINCE: None, DEMAND: demand})
        return current, new
    need = min(max(math.ceil(demand - _EPS), replicas.min), replicas.max)
    want_up = need > current and replicas.running >= current
    want_down = current > replicas.min and demand <= (current - 1) * DOWNSCALE_MARGIN + _EPS
    up_since = _since(state.get(UP_SINCE), now) if want_up else None
    down_since = _since(state.get(DOWN_SINCE), now) if want_down else None
    decision = current
    if up_since is not None and now - up_since >= t.upscale_delay_s:
        decision, up_since = need, None
    elif down_since is not None and now - down_since >= t.downscale_delay_s:
        decision, down_since = current - 1, None
    new.update({UP_SINCE: up_since, DOWN_SINCE: down_since, DEMAND: round(demand, 6)})
    return decision, new


def _since(started: Any, now: float) -> float:
    return float(started) if isinstance(started, int | float) else now


def replica_loads(aggregated: Mapping[str, Mapping[Any, float]] | None) -> list[EngineLoad]:
    """Serve's aggregated custom metrics ({metric: {replica: value}}) as one load per replica
    that reported any; metrics that are not load signals are ignored."""
    by_replica: dict[Any, dict[str, float]] = {}
    for name, values in (aggregated or {}).items():
        for replica, value in values.items():
            by_replica.setdefault(replica, {})[name] = float(value)
    return [EngineLoad.from_metrics(m) for m in by_replica.values()]


class LoadPolicy:
    """Serve's entry point (`AutoscalingPolicy(policy_function=POLICY_PATH, policy_kwargs=...)`).
    A class rather than a function because Serve hands a class its `policy_kwargs` (the role and
    the targets) once; the state between ticks lives in Serve's policy_state, not here."""

    def __init__(self, role: str, **targets: Any):
        self.role = _role(role)  # Serve hands the policy_kwargs over as plain data
        self.demand = DEMAND_OF[self.role]
        self.targets = Targets(**targets)

    def __call__(self, ctx: AutoscalingContext) -> tuple[int, dict[str, Any]]:
        loads = replica_loads(ctx.aggregated_metrics)
        replicas = Replicas(
            target=ctx.target_num_replicas,
            running=ctx.current_num_replicas,
            min=ctx.capacity_adjusted_min_replicas,
            max=ctx.capacity_adjusted_max_replicas,
        )
        demand = self.demand(loads, self.targets) if loads else None
        now = ctx.current_time if ctx.current_time is not None else time.time()
        return decide(demand, replicas, self.targets, now, ctx.policy_state)


def policy_targets(args: ServerArgs) -> dict[str, float | None]:
    """The `Targets` fields from the server arguments, defaults resolved against the engine's
    limits: a replica one full prefill batch behind, or running 3/4 of its sequence cap, is busy."""
    a, e = args.autoscale, args.engine
    return {
        "queued_prompt_tokens": float(a.autoscale_target_queued_tokens or e.max_prefill_tokens),
        "kv_usage": a.autoscale_target_kv_usage,
        "running_sequences": float(
            a.autoscale_target_running or max(1, round(0.75 * e.max_running_requests))
        ),
        "upscale_delay_s": a.autoscale_upscale_delay_s,
        "downscale_delay_s": a.autoscale_downscale_delay_s,
        "ttft_s": a.autoscale_target_ttft_s,
        "itl_s": a.autoscale_target_itl_s,
    }


def deployment_autoscaling(role: Role, args: ServerArgs, num_replicas: int) -> dict[str, Any]:
    """Serve deployment options for the replica count of an engine deployment in `role`:
    `num_replicas` fixed, or, when the role's max replicas
    exceed its min, an `autoscaling_config` with `LoadPolicy` between them, starting from
    `num_replicas` (brought within the bounds). Either way, a replica being removed drains: Serve
    stops routing to it and waits up to `drain_timeout_s` for its requests in flight to finish
    before it stops the engine (which would fail what is left)."""
    role = _role(role)
    a = args.autoscale
    drain = {"graceful_shutdown_timeout_s": a.drain_timeout_s, "graceful_shutdown_wait_loop_s": DRAIN_POLL_S}
    bounds = a.bounds(role)
    if bounds is None:
        return {"num_replicas": num_replicas, **drain}
    lo, hi = bounds
    config = {
        "min_replicas": lo,
        "max_replicas": hi,
        "initial_replicas": min(max(num_replicas, lo), hi),
        "look_back_period_s": a.autoscale_look_back_s,
        "metrics_interval_s": a.autoscale_metrics_interval_s,
        "upscale_delay_s": 0.0,
        "downscale_delay_s": 0.0,
        "policy": {
            "policy_function": POLICY_PATH,
            "policy_kwargs": {"role": role.value, **policy_targets(args)},
        },
    }
    return {"autoscaling_config": config, **drain}


def _role(role: str) -> Role:
    if role not in ROLES:
        raise ValueError(f"autoscaling role must be one of {ROLES}, got {role!r}")
    return Role(role)
