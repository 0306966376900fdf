"""The prefill budget of a mixed step, learned from the steps' times (engine/step_cost.py)."""

import pytest

from radixserve.workers.engine.step_cost import MIN_MIXED_TOKENS, StepCost
from radixserve.workers.executor.plan import BatchKind, ScheduledBatch


def plan(kind, rows):
    return ScheduledBatch(kind, [], [], [rows], [])


def seasoned(ratio, base=0.01, per_row=0.0001, steps=40):
    """A cost model that timed decode steps of 1-8 rows and prefill steps of 64-512 rows of a
    machine where a step costs `base + rows * per_row`."""
    cost = StepCost(ratio)
    for k in range(steps):
        d = 1 + k % 8
        cost.observe(plan(BatchKind.DECODE, d), base + d * per_row)
        n = 64 << (k % 4)
        cost.observe(plan(BatchKind.PREFILL, n), base + n * per_row)
    return cost


def test_it_learns_the_machines_costs():
    cost = seasoned(2.5)
    assert cost.base_s == pytest.approx(0.01, rel=0.02)
    assert cost.per_row_s == pytest.approx(0.0001, rel=0.02)
    assert cost.decode_s(8) == pytest.approx(0.01 + 8 * 0.0001, rel=0.02)


@pytest.mark.parametrize("ratio", [2.0, 2.5, 4.0])
@pytest.mark.parametrize("decodes", [1, 8, 32])
def test_a_mixed_step_costs_ratio_decode_steps(ratio, decodes):
    cost = seasoned(ratio)
    n = cost.mixed_budget(decodes, cap=4096)
    step = 0.01 + (decodes + n) * 0.0001
    decode = 0.01 + decodes * 0.0001
    assert step == pytest.approx(ratio * decode, rel=0.05)
    # More decodes in flight make a decode step longer, so the chunk beside them grows.
    assert cost.mixed_budget(decodes + 8, cap=4096) > n


def test_the_budget_stays_within_the_chunk_and_above_the_floor():
    cost = seasoned(100.0)
    assert cost.mixed_budget(8, cap=300) == 300
    tight = seasoned(1.01)
    assert tight.mixed_budget(8, cap=4096) == MIN_MIXED_TOKENS
    assert tight.mixed_budget(8, cap=10) == 10  # the chunk wins over the floor


def test_without_a_ratio_or_before_any_prefill_it_is_the_chunk():
    assert seasoned(0.0).mixed_budget(8, cap=2048) == 2048
    assert seasoned(1.0).mixed_budget(8, cap=2048) == 2048
    cost = StepCost(2.5)
    assert cost.mixed_budget(8, cap=2048) == 2048  # nothing timed: nothing to go by
    cost.observe(plan(BatchKind.PREFILL, 512), 0.2)
    assert cost.mixed_budget(8, cap=2048) == MIN_MIXED_TOKENS  # no decode step timed yet


def test_it_follows_a_slower_machine():
    cost = seasoned(2.5)
    before = cost.mixed_budget(8, cap=4096)
    for k in range(60):  # the rows got twice as dear (longer contexts, a busier host)
        cost.observe(plan(BatchKind.DECODE, 8), 0.01 + 8 * 0.0002)
        cost.observe(plan(BatchKind.PREFILL, 128 + k), 0.01 + (128 + k) * 0.0002)
    assert cost.per_row_s == pytest.approx(0.0002, rel=0.05)
    assert cost.mixed_budget(8, cap=4096) < before


def test_odd_timings_do_not_unbound_it():
    cost = seasoned(2.5)
    cost.observe(plan(BatchKind.PREFILL, 512), 0.0)  # not timed
    cost.observe(plan(BatchKind.PREFILL, 4), 0.5)  # a short prompt's first step: one-time costs
    assert cost.base_s == pytest.approx(0.01, rel=0.02)
    for _ in range(20):
        cost.observe(plan(BatchKind.PREFILL, 512), 0.009)  # cheaper than `base`: timer noise
    assert cost.per_row_s > 0
    assert cost.mixed_budget(8, cap=10**9) < 10**9
