"""PD autoscaling on a live cluster, each pool on its own signal: one Ray instance, one Serve app
whose prefill pool (PrefillReplica) and decode pool (DecodeReplica) each scale between 1 and 2
replicas (tiny KV pools, one thread each, delays of seconds).

In order on the same app: a burst of long prompts with short outputs scales the prefill pool to 2
(and the new prefill replica serves) while the decode pool stays at 1; after it the prefill pool
scales back to 1; a burst of short prompts with long outputs scales the decode pool to 2 while the
prefill pool stays at 1, and back to 1 after it. Every request gets exactly its tokens, once, and
both pools end at the idle invariant. Replica counts come from Serve's status API.

The targets, and why each burst crosses only its own pool's (demand = summed load / target; a
pool scales up once demand > its replica count, see cluster/autoscaling.py):

- prefill, TARGET_QUEUED = 256 queued prompt tokens per replica. The prefill burst keeps
  PREFILL_THREADS = 4 prompts of LONG_PROMPT = 384 tokens in flight; with MAX_PREFILL_TOKENS =
  512 a replica admits one prompt (and a chunk of the next) per step, so 2-3 prompts (~600-1100
  tokens) wait: demand 2.5-4, above 1 and 2. The decode burst's prompts are SHORT_PROMPT = 16
  tokens: all DECODE_THREADS = 10 of them waiting at once would be 160 tokens, demand 0.625 < 1.
- decode, TARGET_RUNNING = 4 running sequences per replica (TARGET_KV = 0.8 of the KV pool). The
  decode burst keeps 10 sequences decoding LONG_OUT = 224 tokens: demand ~2.5 on running, above 1
  and 2; its KV, 10 * 240 / 4096 = 0.59, is 0.73 replicas. The prefill burst's sequences decode
  one token each on the decode replica: never more than the 4 in flight run there (demand 1.0,
  which needs no second replica), and its reservations hold at most 4 * 386 tokens of the
  decode pool (0.38 of it, 0.47 replicas).
"""

from __future__ import annotations

import httpx
import pytest
from ray import serve

from tests.autoscaling_utils import APP, Requests, burst, end, replica_states, wait_for
from tests.pd_utils import replicas, wait_idle
from tests.serve_utils import running_app

pytestmark = pytest.mark.slow  # starts a live Ray Serve app

PREFILL, DECODE = "PrefillReplica", "DecodeReplica"
KV_TOTAL = 4096
MAX_PREFILL_TOKENS = 512
LONG_PROMPT, SHORT_OUT = 384, 2
SHORT_PROMPT, LONG_OUT = 16, 224
PREFILL_THREADS, DECODE_THREADS = 4, 10
TARGET_QUEUED, TARGET_RUNNING, TARGET_KV = 256, 4, 0.8


@pytest.fixture(scope="module")
def base_url():
    args = {
        "pd": True,
        "prefill_min_replicas": 1,
        "prefill_max_replicas": 2,
        "decode_min_replicas": 1,
        "decode_max_replicas": 2,
        "prefill_num_cpus": 0.5,
        "decode_num_cpus": 0.5,
        "num_threads": 1,
        "dtype": "float32",
        "max_total_tokens": KV_TOTAL,
        "max_prefill_tokens": MAX_PREFILL_TOKENS,
        "kv_transfer_timeout_s": 60,
        # A decode side that fails is an error, not a silent recompute: a lost request shows.
        "pd_on_failure": "error",
        "autoscale_target_queued_tokens": TARGET_QUEUED,
        "autoscale_target_running": TARGET_RUNNING,
        "autoscale_target_kv_usage": TARGET_KV,
        "autoscale_upscale_delay_s": 1,
        "autoscale_downscale_delay_s": 6,  # a burst's pauses are shorter
        "autoscale_look_back_s": 2,
        "autoscale_metrics_interval_s": 0.5,
        "drain_timeout_s": 600,
        "router_sync_interval_s": 1.0,
    }
    # Four replicas of 0.5 CPU at most, and the ingress: logical CPUs, the threads are pinned to 1.
    with running_app(args, num_cpus=4) as base:
        yield base


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=120) as c:
        yield c


def status(deployment: str):
    return serve.status().applications[APP].deployments[deployment]


def assert_one(deployment: str) -> None:
    """The pool holds one running replica and Serve is not moving it (no scaling decision)."""
    s = status(deployment)
    assert replica_states(deployment) == {"RUNNING": 1}, (deployment, s)
    assert str(getattr(s.status, "value", s.status)) == "HEALTHY", (deployment, s)


def served(http: httpx.Client, role: str) -> list[int]:
    return [r["num_requests_total"] for r in replicas(http) if r["role"] == role]


ROLE = {PREFILL: "prefill", DECODE: "decode"}


def burst_scales_up(
    base_url, http, pool: str, other: str, threads: int, prompt_len: int, out: int
) -> Requests:
    """A burst that must scale `pool` to 2 (and the new replica serve) while `other` stays at 1
    throughout; returns its requests, every one answered."""
    requests = Requests(base_url, "pd-autoscale")
    stop, workers = burst(requests, threads, prompt_len, out)
    try:

        def scaled_up() -> bool:
            assert_one(other)
            return replica_states(pool).get("RUNNING") == 2

        wait_for(scaled_up, 300, f"the {ROLE[pool]} pool's scale-up to 2 replicas")

        def both_served() -> bool:
            assert_one(other)
            assert replica_states(pool).get("RUNNING") == 2  # no scale-down while the burst lasts
            counts = served(http, ROLE[pool])
            return len(counts) == 2 and all(c > 0 for c in counts)

        wait_for(both_served, 180, f"the new {ROLE[pool]} replica to serve")
    finally:
        end(stop, workers)
    assert_one(other)
    requests.check()
    return requests


def scales_back_while_serving(base_url, pool: str, other: str) -> None:
    """One client keeps sending short requests while a replica of `pool` drains and goes."""
    requests = Requests(base_url, "pd-autoscale")
    stop, workers = burst(requests, 1, SHORT_PROMPT, 8)
    try:

        def scaled_down() -> bool:
            assert_one(other)
            return replica_states(pool) == {"RUNNING": 1}

        wait_for(scaled_down, 180, f"the {ROLE[pool]} pool's scale-down to 1 replica, drained")
        sent = len(requests.sent)
        wait_for(lambda: len(requests.answers) > sent, 60, "a request served by the remaining replica")
    finally:
        end(stop, workers)
    requests.check()
    assert_one(PREFILL)
    assert_one(DECODE)


def test_long_prompts_scale_the_prefill_pool_and_leave_the_decode_pool(base_url, http):
    wait_idle(http, kv_total=KV_TOTAL, timeout=120)
    assert_one(PREFILL)
    assert_one(DECODE)
    requests = burst_scales_up(base_url, http, PREFILL, DECODE, PREFILL_THREADS, LONG_PROMPT, SHORT_OUT)
    # No request ran twice (or was recomputed elsewhere): each went through one prefill replica
    # and the one decode replica exactly once.
    assert sum(served(http, "prefill")) == len(requests.sent)
    assert sum(served(http, "decode")) == len(requests.sent)


def test_after_the_long_prompts_the_prefill_pool_scales_back_to_one(base_url, http):
    """One client keeps sending short requests while a prefill replica drains and goes."""
    scales_back_while_serving(base_url, PREFILL, DECODE)
    wait_idle(http, kv_total=KV_TOTAL, timeout=60)


def test_long_outputs_scale_the_decode_pool_and_leave_the_prefill_pool(base_url, http):
    wait_idle(http, kv_total=KV_TOTAL, timeout=60)
    assert_one(PREFILL)
    assert_one(DECODE)
    prefill_before = sum(served(http, "prefill"))
    requests = burst_scales_up(base_url, http, DECODE, PREFILL, DECODE_THREADS, SHORT_PROMPT, LONG_OUT)
    # No request ran twice: a second try goes through the prefill pool again, which had one
    # replica throughout. (The decode pool may already be scaling down as the last long outputs
    # finish, taking its count along: it is counted in the first test, where it has one replica.)
    assert sum(served(http, "prefill")) - prefill_before == len(requests.sent)

    # After the burst the decode pool scales back to 1 while a client keeps sending.
    scales_back_while_serving(base_url, DECODE, PREFILL)
    rs = wait_idle(http, kv_total=KV_TOTAL, timeout=60)
    assert sorted(r["role"] for r in rs) == ["decode", "prefill"]
