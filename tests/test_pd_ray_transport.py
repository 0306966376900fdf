"""PD disaggregation live over the Ray object store transport (`--kv-transfer ray`): greedy
output equals the unified engine's, streamed and not; a prefill replica lost mid-prefill; both
pools return to idle after each test."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.pd_utils import MAX_TOKENS, PD_ARGS, PROMPTS, kill_replica, unified_reference, wait_idle
from tests.serve_utils import running_app

pytestmark = pytest.mark.slow  # starts a live Ray Serve app


@pytest.fixture(scope="module")
def reference():
    return unified_reference(PROMPTS)


@pytest.fixture(scope="module")
def http(reference):
    with running_app({**PD_ARGS, "kv_transfer": "ray"}) as base:
        with httpx.Client(base_url=base, timeout=120) as c:
            yield c


@pytest.fixture(autouse=True)
def idle_after(http):
    yield
    wait_idle(http, timeout=240)  # the last test waits for a replacement replica


def test_greedy_output_equals_unified_over_ray(http, reference):
    ids, expected, _ = reference
    sp = {"max_new_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    for prompt_ids, ref in zip(ids, expected):
        out = http.post("/generate", json={"input_ids": prompt_ids, "sampling_params": sp}).json()
        assert out["output_ids"] == ref["output_ids"] and out["text"] == ref["text"]
    info = http.get("/get_server_info").json()
    assert info["kv_transfer"] == "ray"
    decode = next(r for r in info["replicas"] if r["role"] == "decode")
    assert decode["generation_tokens_total"] >= len(ids) * (MAX_TOKENS - 1)


def test_streamed_chat_over_ray(http, reference):
    ids, expected, _ = reference
    body = {"prompt": ids[1], "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    text = ""
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
    assert text == expected[1]["text"]


def test_prefill_replica_lost_during_a_long_prefill(http):
    """Last in the module: the prefill replica dies while it computes a long prompt. The request
    is still answered in full (sent again once Serve replaced the replica, or recomputed if its
    first token was out), and both pools end idle: the decode side's reservation was freed."""
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    text = " ".join(words[i % len(words)] for i in range(2500))
    sp = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(http.post, "/generate", json={"text": text, "sampling_params": sp}, timeout=300)
        time.sleep(1.0)  # the prompt is being prefilled (seconds on one thread)
        kill_replica("PrefillReplica")
        r = fut.result()
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert meta["completion_tokens"] == 6 and meta["finish_reason"]["type"] == "length"
    wait_idle(http, timeout=240)
