"""Autoscaling on a live cluster: one Ray instance, one Serve app whose engine deployment scales
between 1 and 2 replicas (tiny KV pools, one thread each, delays of seconds).

In order on the same app: a burst of requests scales the engine up to 2 and the new replica
serves; once the burst ends it scales back to 1 while requests keep coming; a replica told to
stop (the app deleted) finishes the generation it runs. Every request gets exactly its tokens,
once. Replica counts come from Serve's status API."""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections.abc import Callable

import httpx
import pytest
from ray import serve

from tests.serve_utils import running_app

pytestmark = pytest.mark.slow  # starts a live Ray Serve app

APP, ENGINE = "radixserve", "EngineReplica"
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
    deployment = serve.status().applications[APP].deployments[ENGINE]
    return {str(getattr(k, "value", k)): v for k, v in deployment.replica_states.items()}


def app_status() -> str | None:
    app = serve.status().applications.get(APP)
    return None if app is None else str(getattr(app.status, "value", app.status))


def wait_for(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            app = serve.status().applications.get(APP)
            raise AssertionError(f"timed out after {timeout}s waiting for {what}; app: {app}")
        time.sleep(0.25)


def server_replicas(client: httpx.Client) -> list[dict]:
    return client.get("/get_server_info").json()["replicas"]


_ids = itertools.count()


class Requests:
    """Sends /generate requests with distinct prompts (nothing shared in any cache) and keeps
    every answer by its request id."""

    def __init__(self, base_url: str):
        self.base_url = base_url
        self.sent: dict[str, int] = {}  # rid -> max_new_tokens
        self.answers: dict[str, list] = {}  # rid -> every (status, body) received for it
        self.lock = threading.Lock()

    def one(self, client: httpx.Client, max_new_tokens: int) -> None:
        n = next(_ids)
        rid = f"autoscale-{n}"
        rng = random.Random(n)
        body = {
            "input_ids": [rng.randrange(1000, 40000) for _ in range(PROMPT_LEN)],
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True},
            "rid": rid,
        }
        with self.lock:
            self.sent[rid] = max_new_tokens
        r = client.post("/generate", json=body)
        with self.lock:
            self.answers.setdefault(rid, []).append((r.status_code, r.json()))

    def loop(self, stop: threading.Event, max_new_tokens: int) -> None:
        with httpx.Client(base_url=self.base_url, timeout=600) as client:
            while not stop.is_set():
                self.one(client, max_new_tokens)

    def check(self) -> None:
        """Every request answered once, with 200 and exactly its tokens."""
        assert set(self.answers) == set(self.sent)
        for rid, answers in self.answers.items():
            assert len(answers) == 1, (rid, answers)
            ((status, body),) = answers
            assert status == 200, (rid, body)
            meta = body["meta_info"]
            assert meta["id"] == rid
            assert len(body["output_ids"]) == meta["completion_tokens"] == self.sent[rid], (rid, meta)
            assert meta["finish_reason"]["type"] == "length", (rid, meta)


def start(threads: list[threading.Thread]) -> list[threading.Thread]:
    for t in threads:
        t.start()
    return threads


def test_a_burst_scales_up_to_two_replicas_and_both_serve(base_url):
    assert replica_states() == {"RUNNING": 1}
    requests, stop = Requests(base_url), threading.Event()
    workers = start([threading.Thread(target=requests.loop, args=(stop, BURST_TOKENS)) for _ in range(8)])
    try:
        with httpx.Client(base_url=base_url, timeout=60) as client:
            wait_for(lambda: replica_states().get("RUNNING") == 2, 300, "the scale-up to 2 replicas")

            def both_served() -> bool:
                assert replica_states().get("RUNNING") == 2  # no scale-down while the burst lasts
                replicas = server_replicas(client)
                return len(replicas) == 2 and all(r["num_requests_total"] > 0 for r in replicas)

            wait_for(both_served, 120, "the new replica to serve")
    finally:
        stop.set()
        for t in workers:
            t.join(600)
    requests.check()
    with httpx.Client(base_url=base_url, timeout=60) as client:
        served = sum(r["num_requests_total"] for r in server_replicas(client))
    assert served == len(requests.sent)  # no request ran twice


def test_after_the_burst_it_scales_back_to_one_while_requests_keep_coming(base_url):
    """One client keeps sending short requests (one running sequence, an eighth of a replica's target): after
    the downscale delay one replica drains and goes; no request is lost on the way."""
    requests, stop = Requests(base_url), threading.Event()
    worker = start([threading.Thread(target=requests.loop, args=(stop, 16))])[0]
    try:
        wait_for(lambda: replica_states() == {"RUNNING": 1}, 120, "the scale-down to 1 replica, drained")
        sent = len(requests.sent)
        wait_for(lambda: len(requests.answers) > sent, 60, "a request served by the remaining replica")
    finally:
        stop.set()
        worker.join(600)
    requests.check()


def test_a_replica_being_removed_finishes_what_it_runs(base_url):
    """A long generation streams from the engine while its replica is told to stop (the app is
    deleted): the replica drains (Serve waits for the stream, up to drain_timeout_s, before the
    engine stops) and the stream gets every token, though most come after the stop."""
    from radixserve.workers.protocol import GenerateRequest, OutputChunk, SamplingParams

    params = SamplingParams(max_new_tokens=LONG_TOKENS, temperature=0, ignore_eos=True)
    request = GenerateRequest(list(range(1000, 1000 + PROMPT_LEN)), params, stream=True, rid="drained")
    handle = serve.get_deployment_handle(ENGINE, APP)
    stream = handle.options(stream=True).generate.remote(request.to_dict())
    messages = [next(stream), next(stream)]  # accepted, then the first tokens
    serve.delete(APP, _blocking=False)

    # The replica is told to stop at once, and drains (with the 5 s deadline the EngineReplica
    # class declares, it would be killed mid-stream).
    wait_for(lambda: app_status() == "DELETING", 30, "the app to be deleting")
    messages += list(stream)
    chunks = [OutputChunk.from_dict(m) for m in messages]
    assert all("error" not in m for m in messages), messages[-1]
    assert sum(len(c.token_ids) for c in chunks) == LONG_TOKENS
    assert chunks[-1].finished and chunks[-1].finish_reason["type"] == "length"
    wait_for(lambda: app_status() is None, 60, "the app to go once drained")
