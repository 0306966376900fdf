"""Autoscaling on a live cluster: one Ray instance, one Serve app whose engine deployment scales
between 1 and 2 replicas (tiny KV pools, one thread each, delays of seconds).

In order on the same app: a burst of requests scales the engine up to 2 and the new replica
serves; once the burst ends it scales back to 1 while requests keep coming; a replica told to
stop (the app deleted) finishes the generation it runs. Every request gets exactly its tokens,
once. Replica counts come from Serve's status API."""

from __future__ import annotations

import httpx
import pytest
from ray import serve

from tests.autoscaling_utils import APP, Requests, burst, end, wait_for
from tests.autoscaling_utils import replica_states as states_of
from tests.serve_utils import running_app

pytestmark = pytest.mark.slow  # starts a live Ray Serve app

ENGINE = "EngineReplica"
KV_TOTAL = 1024
PROMPT_LEN = 48
BURST_TOKENS = 8
LONG_TOKENS = 900  # most of a replica's KV pool: seconds of decoding at least


@pytest.fixture(scope="module")
def base_url():
    args = {
        "dp": 1,
        "min_replicas": 1,
        "max_replicas": 2,
        "replica_num_cpus": 0.5,
        "max_total_tokens": KV_TOTAL,
        "num_threads": 1,
        "max_running_requests": 2,
        # Six prompts waiting (~300 tokens) need 2 replicas; two running sequences need less than 1.
        "autoscale_target_queued_tokens": 64,
        "autoscale_target_running": 8,
        "autoscale_upscale_delay_s": 1,
        "autoscale_downscale_delay_s": 6,  # a burst's pauses are shorter
        "autoscale_look_back_s": 2,
        "autoscale_metrics_interval_s": 0.5,
        "drain_timeout_s": 600,
        "router_sync_interval_s": 1.0,
    }
    with running_app(args) as base:
        yield base


def replica_states() -> dict[str, int]:
    return states_of(ENGINE)


def app_status() -> str | None:
    app = serve.status().applications.get(APP)
    return None if app is None else str(getattr(app.status, "value", app.status))


def server_replicas(client: httpx.Client) -> list[dict]:
    return client.get("/get_server_info").json()["replicas"]


def test_a_burst_scales_up_to_two_replicas_and_both_serve(base_url):
    assert replica_states() == {"RUNNING": 1}
    requests = Requests(base_url, "autoscale")
    stop, workers = burst(requests, 8, PROMPT_LEN, BURST_TOKENS)
    try:
        with httpx.Client(base_url=base_url, timeout=60) as client:
            wait_for(lambda: replica_states().get("RUNNING") == 2, 300, "the scale-up to 2 replicas")

            def both_served() -> bool:
                assert replica_states().get("RUNNING") == 2  # no scale-down while the burst lasts
                replicas = server_replicas(client)
                return len(replicas) == 2 and all(r["num_requests_total"] > 0 for r in replicas)

            wait_for(both_served, 120, "the new replica to serve")
    finally:
        end(stop, workers)
    requests.check()
    with httpx.Client(base_url=base_url, timeout=60) as client:
        served = sum(r["num_requests_total"] for r in server_replicas(client))
    assert served == len(requests.sent)  # no request ran twice


def test_after_the_burst_it_scales_back_to_one_while_requests_keep_coming(base_url):
    """One client keeps sending short requests (one running sequence, an eighth of a replica's target): after
    the downscale delay one replica drains and goes; no request is lost on the way."""
    requests = Requests(base_url, "autoscale")
    stop, workers = burst(requests, 1, PROMPT_LEN, 16)
    try:
        wait_for(lambda: replica_states() == {"RUNNING": 1}, 120, "the scale-down to 1 replica, drained")
        sent = len(requests.sent)
        wait_for(lambda: len(requests.answers) > sent, 60, "a request served by the remaining replica")
    finally:
        end(stop, workers)
    requests.check()


def test_a_replica_being_removed_finishes_what_it_runs(base_url):
    """A long generation streams from the engine while its replica is told to stop (the app is
    deleted): the replica drains (Serve waits for the stream, up to drain_timeout_s, before the
    engine stops) and the stream gets every token, though most come after the stop."""
    from radixserve.workers.protocol import (
        Accepted,
        GenerateRequest,
        OutputChunk,
        SamplingParams,
        decode_event,
    )

    params = SamplingParams(max_new_tokens=LONG_TOKENS, temperature=0, ignore_eos=True)
    request = GenerateRequest(list(range(1000, 1000 + PROMPT_LEN)), params, stream=True, rid="drained")
    handle = serve.get_deployment_handle(ENGINE, APP)
    stream = handle.options(stream=True).generate.remote(request.to_dict())
    events = [decode_event(next(stream)), decode_event(next(stream))]  # accepted, then the first tokens
    serve.delete(APP, _blocking=False)

    # The replica is told to stop at once, and drains (with the 5 s deadline the EngineReplica
    # class declares, it would be killed mid-stream).
    wait_for(lambda: app_status() == "DELETING", 30, "the app to be deleting")
    events += [decode_event(m) for m in stream]
    assert events[0] == Accepted("drained")
    chunks = events[1:]
    assert all(isinstance(c, OutputChunk) for c in chunks), chunks[-1]
    assert sum(len(c.token_ids) for c in chunks) == LONG_TOKENS
    assert chunks[-1].finished and chunks[-1].finish_reason["type"] == "length"
    wait_for(lambda: app_status() is None, 60, "the app to go once drained")
