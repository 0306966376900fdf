"""PD disaggregation live over the Ray object store transport (`--kv-transfer ray`): greedy
output equals the unified engine's, streamed and not, and both pools return to idle."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.pd_utils import MAX_TOKENS, PD_ARGS, PROMPTS, unified_reference, wait_idle
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
    wait_idle(http)


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
