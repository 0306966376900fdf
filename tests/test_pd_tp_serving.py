"""PD with tensor-parallel replicas live: one Ray instance and one Serve app per layout (ingress, a
prefill and a decode replica of the default model):
- gloo, both pools at tp 2 (6 + 3 query heads, 2 + 1 KV heads per rank): each rank sends its own
  heads to the same rank of the decode replica;
- the Ray object store, a tp-1 prefill replica into a tp-2 decode replica (--prefill-tp 1
  --decode-tp 2): the prefill rank sends KV heads [0, 2) to decode rank 0 and [2, 3) to rank 1.
Greedy output equals the unified tp_size 1 engine's; streaming, n and aborts work; both pools
return to idle after each test."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.pd_utils import MAX_TOKENS, PD_ARGS, PROMPTS, replicas, unified_reference, wait_idle
from tests.serve_utils import abort_mid_stream, running_app

pytestmark = pytest.mark.slow  # starts a live Ray Serve app

GREEDY = {"max_new_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
# Past a few tokens every rank's share of the KV shapes the output: a rank whose heads did not
# arrive would change it.
LONG = " ".join(f"Item {i}: a line of a list that the model must attend over." for i in range(12))


@pytest.fixture(scope="module")
def reference():
    return unified_reference([*PROMPTS, LONG])  # before Ray starts: the replicas get the CPUs to themselves


LAYOUTS = {
    "gloo-tp2": {"kv_transfer": "gloo", "tp_size": 2},
    "ray-tp1-into-tp2": {"kv_transfer": "ray", "prefill_tp": 1, "decode_tp": 2},
}
LAYOUT_TPS = {"gloo-tp2": (2, 2), "ray-tp1-into-tp2": (1, 2)}  # (prefill, decode) per /get_server_info


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def http(layout, reference):
    with running_app({**PD_ARGS, **LAYOUTS[layout]}, num_cpus=4) as base:
        with httpx.Client(base_url=base, timeout=120) as c:
            yield c


@pytest.fixture(autouse=True)
def idle_after(http):
    yield
    wait_idle(http, timeout=120)


def test_greedy_output_equals_unified_tp1(http, reference, layout):
    ids, expected, _ = reference
    for prompt_ids, ref in zip(ids, expected):
        out = http.post("/generate", json={"input_ids": prompt_ids, "sampling_params": GREEDY}).json()
        assert out["output_ids"] == ref["output_ids"] and out["text"] == ref["text"]
    # Both sides took part: the prefill replica the first tokens, the decode replica the rest.
    stats = {r["role"]: r for r in replicas(http)}
    assert (stats["prefill"]["tp_size"], stats["decode"]["tp_size"]) == LAYOUT_TPS[layout]
    assert stats["prefill"]["generation_tokens_total"] >= len(ids)
    assert stats["decode"]["generation_tokens_total"] >= len(ids) * (MAX_TOKENS - 1)


def test_streaming_and_n(http, reference):
    _, expected, _ = reference
    body = {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "n": 2}
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        assert s.status_code == 200
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    texts = ["", ""]
    for e in events[:-1]:
        for choice in json.loads(e)["choices"]:
            texts[choice["index"]] += choice["text"]
    assert texts == [expected[0]["text"]] * 2


def test_abort_frees_both_pools(http):
    abort_mid_stream(http)  # the fixture checks both pools
