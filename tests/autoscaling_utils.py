"""What the live autoscaling tests share: Serve's view of a deployment's replicas, waiting on it,
and a tally of requests sent from client threads, each of which must be answered exactly once."""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections.abc import Callable

import httpx
from ray import serve

APP = "radixserve"


def replica_states(deployment: str) -> dict[str, int]:
    """Serve's replica count of `deployment` by state (RUNNING, STARTING, STOPPING, ...)."""
    d = serve.status().applications[APP].deployments[deployment]
    return {str(getattr(k, "value", k)): v for k, v in d.replica_states.items()}


def wait_for(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            app = serve.status().applications.get(APP)
            raise AssertionError(f"timed out after {timeout}s waiting for {what}; app: {app}")
        time.sleep(0.25)


_ids = itertools.count()


class Requests:
    """Sends /generate requests with distinct random prompts (nothing shared in any cache) and
    keeps every answer by its request id."""

    def __init__(self, base_url: str, prefix: str):
        self.base_url = base_url
        self.prefix = prefix
        self.sent: dict[str, int] = {}  # rid -> max_new_tokens
        self.answers: dict[str, list] = {}  # rid -> every (status, body) received for it
        self.lock = threading.Lock()

    def one(self, client: httpx.Client, prompt_len: int, max_new_tokens: int) -> None:
        n = next(_ids)
        rid = f"{self.prefix}-{n}"
        rng = random.Random(n)
        body = {
            "input_ids": [rng.randrange(1000, 40000) for _ in range(prompt_len)],
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True},
            "rid": rid,
        }
        with self.lock:
            self.sent[rid] = max_new_tokens
        r = client.post("/generate", json=body)
        with self.lock:
            self.answers.setdefault(rid, []).append((r.status_code, r.json()))

    def loop(self, stop: threading.Event, prompt_len: int, max_new_tokens: int) -> None:
        with httpx.Client(base_url=self.base_url, timeout=600) as client:
            while not stop.is_set():
                self.one(client, prompt_len, max_new_tokens)

    def check(self) -> None:
        """Every request answered once, with 200 and exactly its tokens."""
        assert set(self.answers) == set(self.sent)
        for rid, answers in self.answers.items():
            assert len(answers) == 1, (rid, answers)
            ((code, body),) = answers
            assert code == 200, (rid, body)
            meta = body["meta_info"]
            assert meta["id"] == rid
            assert len(body["output_ids"]) == meta["completion_tokens"] == self.sent[rid], (rid, meta)
            assert meta["finish_reason"]["type"] == "length", (rid, meta)


def burst(
    requests: Requests, threads: int, prompt_len: int, max_new_tokens: int
) -> tuple[threading.Event, list[threading.Thread]]:
    """`threads` clients sending back to back until the event is set (see `end`)."""
    stop = threading.Event()
    workers = [
        threading.Thread(target=requests.loop, args=(stop, prompt_len, max_new_tokens))
        for _ in range(threads)
    ]
    for t in workers:
        t.start()
    return stop, workers


def end(stop: threading.Event, workers: list[threading.Thread]) -> None:
    stop.set()
    for t in workers:
        t.join(600)
    assert not any(t.is_alive() for t in workers)
