"""The autoscaling policies on recorded load traces, and the adapter Serve calls.

A trace is the deployment's whole load, one sample per second (what Serve's per-replica window
averages add up to); the simulation splits it evenly over the replicas that run, feeds it to
`decide` with the controller's clock, applies each decision as the new target, and brings new
replicas up `startup_s` later. Tests assert the exact seconds at which the count changes."""

from __future__ import annotations

import dataclasses

import pytest

from radixserve.cluster.autoscaling import (
    DEMAND,
    DEMAND_OF,
    DOWN_SINCE,
    UP_SINCE,
    LoadPolicy,
    Replicas,
    Targets,
    decide,
    decode,
    prefill,
    replica_loads,
    unified,
)
from radixserve.workers.protocol import EngineLoad

T = Targets(
    queued_prompt_tokens=1000, kv_usage=0.8, running_sequences=8, upscale_delay_s=5, downscale_delay_s=20
)
T0 = 1_000.0  # the controller's clock at the first sample


def tokens(n: float) -> EngineLoad:
    return EngineLoad(queued_prompt_tokens=n)


IDLE = EngineLoad()


def segments(*parts: tuple[int, EngineLoad]) -> list[EngineLoad]:
    """(seconds, whole-deployment load) segments as one sample per second."""
    return [load for seconds, load in parts for _ in range(seconds)]


def split(total: EngineLoad, n: int) -> list[EngineLoad]:
    """Even shares; a latency too (a trace's latency is one replica's at the whole load)."""
    return [
        EngineLoad(
            total.queued_prompt_tokens / n,
            total.running_sequences / n,
            total.queued_sequences / n,
            total.kv_usage / n,
            total.ttft_s / n,
            total.itl_s / n,
        )
        for _ in range(n)
    ]


def simulate(trace, role="unified", start=1, lo=1, hi=8, startup_s=0, t=T):
    """The (second, new count) of every change of the target."""
    target = running = start
    ready_at, state, changes = 0.0, {}, []
    for i, total in enumerate(trace):
        now = T0 + i
        if running < target and now >= ready_at:
            running = target
        running = min(running, target)  # a removed replica leaves at once
        loads = split(total, running)
        demand = DEMAND_OF[role](loads, t) if loads else None
        new, state = decide(demand, Replicas(target, running, lo, hi), t, now, state)
        if new > target:
            ready_at = now + startup_s
        if new != target:
            changes.append((i, new))
        target = new
    return changes


def test_demand_of_each_role():
    loads = [EngineLoad(1500, 4, 3, 0.6), EngineLoad(500, 4, 0, 0.6)]
    assert prefill(loads, T) == 2.0  # 2000 queued tokens at 1000 per replica
    assert decode(loads, T) == pytest.approx(1.5)  # KV 1.2 at 0.8 (1.5) beats 8 running at 8 (1.0)
    assert decode([EngineLoad(0, 20, 0, 0.1)], T) == 2.5  # running sequences win here
    assert unified(loads, T) == 2.0


def test_burst_scales_up_at_once_then_down_one_by_one_after_the_delay():
    trace = segments((5, IDLE), (30, tokens(5000)), (60, IDLE))
    # Above 1 replica's target from second 5: at second 10 straight to 5 replicas (they start in
    # 3 s; 5000 tokens at 5 replicas is on target). Idle from second 35: one replica at 55, the
    # next 20 s after that step.
    assert simulate(trace, role="prefill", startup_s=3) == [(10, 5), (55, 4), (76, 3)]


def test_a_burst_past_max_stops_at_max():
    assert simulate(segments((10, tokens(50_000))), role="prefill", hi=3) == [(5, 3)]


def test_no_second_step_up_while_the_first_ones_start():
    trace = segments((10, tokens(3000)), (30, tokens(6000)))
    # 3 at second 5; 6000 tokens need 6 from second 10, but the two new replicas run only from
    # second 15: the timer starts then.
    assert simulate(trace, role="prefill", startup_s=10) == [(5, 3), (20, 6)]


def test_plateau_holds():
    # 20 running sequences (2.5 replicas at 8) and KV 1.5 (1.9 at 0.8) on 3 replicas.
    trace = segments((300, EngineLoad(0, 20, 0, 1.5)))
    assert simulate(trace, role="decode", start=3) == []


# Demand (in replicas, unified: queued tokens / 1000) hovering around 1: never above for 5 s in a
# row (at most 4), never below 0.8.
NOISE = [1.08, 0.93, 1.10, 1.04, 1.02, 0.97, 1.05, 0.90, 1.09, 1.03, 1.01, 1.06, 0.95, 0.99, 1.07, 0.92]


def test_noise_around_a_threshold_does_not_flap():
    trace = [tokens(1000 * d) for d in NOISE * 20]
    assert simulate(trace, start=1) == []  # never above for the whole up delay
    assert simulate(trace, start=2) == []  # inside the band: not above 2, not at or below 0.8
    # The same noise around the down threshold of 2 replicas (0.8): dips below it are shorter
    # than the down delay.
    around_down = [tokens(800 * d) for d in NOISE * 20]
    assert simulate(around_down, start=2) == []


def test_noise_that_settles_above_then_scales_once():
    trace = [tokens(1000 * d) for d in NOISE] + segments((40, tokens(1100)))
    assert simulate(trace, start=1) == [(len(NOISE) + 5, 2)]


def test_drop_to_idle_scales_down_only_after_the_delay_and_not_below_min():
    trace = segments((10, EngineLoad(0, 28, 0, 1.0)), (100, IDLE))  # 3.5 replicas of sequences
    assert simulate(trace, start=4, lo=2) == [(30, 3), (51, 2)]


def test_a_blip_restarts_the_down_timer():
    trace = segments((15, IDLE), (1, tokens(1500)), (30, IDLE))
    assert simulate(trace, start=2) == [(36, 1)]  # 20 s after the blip, not after second 0


def test_no_metrics_hold_the_count_and_reset_the_timers():
    state = {UP_SINCE: 1.0, DOWN_SINCE: 2.0, "__decision_counters": 3}
    new, state = decide(None, Replicas(2, 2, 1, 4), T, 50.0, state)
    assert new == 2
    assert state == {UP_SINCE: None, DOWN_SINCE: None, DEMAND: None, "__decision_counters": 3}


def test_a_count_outside_the_bounds_is_brought_within_at_once():
    assert decide(0.0, Replicas(9, 9, 1, 4), T, 0.0, {})[0] == 4
    assert decide(9.0, Replicas(1, 1, 2, 4), T, 0.0, {})[0] == 2


def test_replica_loads_from_serve_metrics():
    aggregated = {
        "queued_prompt_tokens": {"r1": 300.0, "r2": 50.5},
        "running_sequences": {"r1": 2.0, "r2": 1.5},
        "kv_usage": {"r1": 0.25},
        "ttft_s": {"r2": 0.75},
        "itl_s": {"r1": 0.02},
        "running_requests": {"r1": 9.0},  # Serve's own: not a load signal
    }
    assert replica_loads(aggregated) == [
        EngineLoad(300.0, 2.0, 0, 0.25, itl_s=0.02),
        EngineLoad(50.5, 1.5, 0, 0, ttft_s=0.75),
    ]
    assert replica_loads(None) == replica_loads({}) == []


def context(policy_state, target, aggregated, now, config=None):
    from ray.serve._private.common import DeploymentID
    from ray.serve.config import AutoscalingContext

    return AutoscalingContext(
        deployment_id=DeploymentID(name="EngineReplica", app_name="radixserve"),
        deployment_name="EngineReplica",
        app_name="radixserve",
        current_num_replicas=target,
        target_num_replicas=target,
        running_replicas=[],
        total_num_requests=1.0,
        total_queued_requests=0.0,
        aggregated_metrics=lambda: aggregated,
        raw_metrics=None,
        capacity_adjusted_min_replicas=1,
        capacity_adjusted_max_replicas=4,
        policy_state=policy_state,
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=now,
        config=config,
    )


def test_serve_wrapped_policy_follows_our_delay_and_passes_our_count():
    """Through Serve's own wrapper, with the autoscaling_config deployment_autoscaling builds:
    Serve adds no delay of its own, the count passes as decided, and state survives the ticks."""
    from ray.serve.autoscaling_policy import _apply_autoscaling_config
    from ray.serve.config import AutoscalingConfig

    from radixserve.cluster.autoscaling import deployment_autoscaling
    from radixserve.cluster.config import ServerArgs

    args = ServerArgs.from_dict(
        {"max_replicas": 4, "autoscale_target_queued_tokens": 1000, "autoscale_upscale_delay_s": 5}
    )
    config = AutoscalingConfig(**deployment_autoscaling("unified", args, 1)["autoscaling_config"])
    kwargs = config.policy.policy_kwargs
    policy = _apply_autoscaling_config(LoadPolicy(**kwargs))
    busy = {"queued_prompt_tokens": {"r1": 2500.0}}
    state: dict = {}
    seen = []
    for now in (100.0, 102.0, 105.0):
        target, state = policy(context(state, 1, busy, now, config))
        seen.append(target)
    assert seen == [1, 1, 3]  # 2500 tokens at 1000 per replica, after 5 s
    assert state[UP_SINCE] is None and state[DEMAND] == 2.5


def test_load_policy_refuses_an_unknown_role():
    with pytest.raises(ValueError, match="role"):
        LoadPolicy(role="mixed", **{f: 1.0 for f in Targets.__dataclass_fields__})
    with pytest.raises(ValueError, match="targets"):
        Targets(0, 0.8, 8, 1, 1)


# T with latency targets: 1 s to the first token, 50 ms between tokens.
TL = dataclasses.replace(T, ttft_s=1.0, itl_s=0.05)


def test_latency_is_a_signal_only_with_a_target():
    loads = [
        EngineLoad(500, 2, 0, 0.2, ttft_s=1.5, itl_s=0.08),
        EngineLoad(0, 2, 0, 0.2, ttft_s=0.5, itl_s=0.04),
    ]
    assert prefill(loads, T) == 0.5 and decode(loads, T) == 0.5  # 500 tokens; 4 running at 8
    # Each replica's latency in targets, summed: 1.5 + 0.5 at 1 s; 0.08 + 0.04 at 0.05 s.
    assert prefill(loads, TL) == 2.0
    assert decode(loads, TL) == pytest.approx(2.4)
    assert unified(loads, TL) == pytest.approx(2.4)
    # The larger signal wins: a backlog of 5000 tokens needs 5 replicas whatever the latency.
    assert prefill([EngineLoad(5000, ttft_s=0.1)], TL) == 5.0


def test_ttft_above_its_target_scales_the_prefill_pool_with_no_backlog():
    """No prompt tokens wait (the replicas keep up, slowly): 3 s to the first token at 1 s per
    replica asks for 3 replicas after the up delay; back on target it holds; once fast again the
    pool steps down one at a time after the down delay."""
    trace = segments((5, IDLE), (30, EngineLoad(ttft_s=3.0)), (60, EngineLoad(ttft_s=0.3)))
    assert simulate(trace, role="prefill", t=TL) == [(10, 3), (55, 2), (76, 1)]
    assert simulate(trace, role="prefill") == []  # without a target latency is no signal


def test_itl_above_its_target_scales_the_decode_pool():
    # 3 sequences at 0.1 s per token on one replica (KV and running sequences far below target):
    # 2 replicas at 50 ms; on 2 replicas the ITL halves to the target and the count holds.
    trace = segments((40, EngineLoad(0, 3, 0, 0.1, itl_s=0.1)))
    assert simulate(trace, role="decode", t=TL) == [(5, 2)]


def test_latency_targets_must_be_positive():
    with pytest.raises(ValueError, match="targets"):
        dataclasses.replace(T, ttft_s=0.0)
    with pytest.raises(ValueError, match="targets"):
        dataclasses.replace(T, itl_s=-1.0)
