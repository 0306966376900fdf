"""An expert-parallel MoE replica behind the HTTP server: one Ray instance and one Serve app for
the module, a tiny random Qwen3-MoE checkpoint (8 experts, two per token) at tp_size 2 and
ep_size 2, so each rank holds 4 of every layer's experts and the attention heads are split too.
Rank 0 is the Serve replica, rank 1 a Ray actor in its placement group. Greedy output over HTTP
equals transformers' on the same checkpoint."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.engine_utils import hf_greedy
from tests.serve_utils import running_app, wait_idle
from tests.tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.slow  # starts a live Ray Serve app

KV_TOTAL = 2048
MAX_TOKENS = 10
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], list(range(200, 260)), [42] * 5]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ep"), "qwen3_moe")


@pytest.fixture(scope="module")
def reference(checkpoint):
    return hf_greedy(checkpoint, PROMPTS, MAX_TOKENS)  # before Ray starts


@pytest.fixture(scope="module")
def url(checkpoint, reference):
    args = {
        "model_path": checkpoint,
        "tp_size": 2,
        "ep_size": 2,
        "dtype": "float32",
        "max_total_tokens": KV_TOTAL,
        "num_threads": 1,
        "replica_num_cpus": 1,
    }
    with running_app(args, num_cpus=2) as base:
        yield base


@pytest.fixture(scope="module")
def http(url):
    with httpx.Client(base_url=url, timeout=120) as c:
        yield c


def test_greedy_equals_transformers_with_experts_over_two_ranks(http, reference):
    info = http.get("/get_server_info").json()
    assert (info["tp_size"], info["ep_size"]) == (2, 2)
    sp = {"max_new_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    for ids, expected in zip(PROMPTS, reference):
        out = http.post("/generate", json={"input_ids": ids, "sampling_params": sp})
        assert out.status_code == 200, out.text
        assert out.json()["output_ids"] == expected
    wait_idle(http, KV_TOTAL)


def test_streaming_and_n_through_openai(http):
    body = {"prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0, "n": 2, "ignore_eos": True}
    full = http.post("/v1/completions", json=body)
    assert full.status_code == 200, full.text
    expected = [c["text"] for c in sorted(full.json()["choices"], key=lambda c: c["index"])]
    texts = {0: "", 1: ""}
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    texts[c["index"]] += c["text"]
    assert [texts[0], texts[1]] == expected and expected[0] == expected[1]  # greedy: n equal choices
    wait_idle(http, KV_TOTAL)
