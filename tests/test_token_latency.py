"""TokenLatency, the engine's TTFT and ITL signals for autoscaling, on a controlled clock."""

from __future__ import annotations

import pytest

from radixserve.workers.engine.request import Req
from radixserve.workers.engine.token_latency import TokenLatency
from radixserve.workers.protocol import SamplingParams


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def req(rid: str, arrival: float) -> Req:
    return Req(rid, 0, [1, 2, 3], SamplingParams(), arrival=arrival)


def step(latency: TokenLatency, *reqs: Req) -> None:
    for r in reqs:
        r.output_ids.append(7)
    latency.on_tokens(reqs)


def test_first_tokens_give_the_ttft_and_later_ones_the_itl():
    clock = Clock()
    latency = TokenLatency(window_s=30.0, clock=clock)
    assert latency.means() == {"ttft_s": 0.0, "itl_s": 0.0}  # no samples: nothing to scale on
    a, b = req("a", arrival=999.0), req("b", arrival=999.5)
    step(latency, a, b)  # at 1000: TTFTs 1.0 and 0.5
    assert latency.means() == {"ttft_s": 0.75, "itl_s": 0.0}
    clock.now += 0.1
    step(latency, a, b)  # intervals of 0.1 each
    clock.now += 0.3
    step(latency, a)  # 0.3 since a's last token
    assert latency.means() == {
        "ttft_s": 0.75,
        "itl_s": pytest.approx(0.5 / 3, abs=1e-6),
    }  # (0.1 + 0.1 + 0.3) / 3


def test_samples_leave_the_window_and_an_idle_engine_reports_nothing():
    clock = Clock()
    latency = TokenLatency(window_s=30.0, clock=clock)
    slow = req("slow", arrival=990.0)
    step(latency, slow)  # TTFT 10 s at 1000
    clock.now += 20.0
    fast = req("fast", arrival=1019.0)
    step(latency, fast)  # TTFT 1 s at 1020
    assert latency.means()["ttft_s"] == 5.5
    clock.now += 15.0  # 1035: the slow sample is older than 30 s
    assert latency.means()["ttft_s"] == 1.0
    clock.now += 20.0
    assert latency.means() == {"ttft_s": 0.0, "itl_s": 0.0}


def test_a_sequence_whose_first_token_came_from_elsewhere_has_no_ttft_here():
    """PD decode: the first token was the prefill replica's; the next one's interval counts
    from its admission here."""
    clock = Clock()
    latency = TokenLatency(window_s=30.0, clock=clock)
    r = req("pd", arrival=900.0)
    r.output_ids.append(5)
    latency.on_first_token(r)
    clock.now += 0.05
    step(latency, r)
    assert latency.means() == {"ttft_s": 0.0, "itl_s": pytest.approx(0.05)}
