"""PD disaggregation live, over gloo: one Ray instance and one Serve app (ingress, one prefill
and one decode replica of the default model) for the whole module, driven over HTTP. Greedy
output equals the unified engine's; streaming, n, stop strings, logprobs, structured output,
cached_tokens and aborts work as in unified mode; both pools return to idle after each test."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.pd_utils import (
    LONG_TOKENS,
    MAX_TOKENS,
    PARITY_PARAMS,
    PD_ARGS,
    PROMPTS,
    kill_replica,
    parity_answer,
    replicas,
    unified_answers,
    unified_reference,
    wait_idle,
)
from tests.serve_utils import running_app

pytestmark = pytest.mark.slow  # starts a live Ray Serve app


@pytest.fixture(scope="module")
def reference():
    return unified_reference(PROMPTS)  # before Ray starts: the replicas get the CPUs to themselves


PARITY_PROMPT = "Answer yes or no, then one word: is the sea salty? Then say why, and"


@pytest.fixture(scope="module")
def parity_reference(reference):
    return unified_answers(PARITY_PROMPT, PARITY_PARAMS)  # before Ray starts, as `reference`


@pytest.fixture(scope="module")
def url(reference, parity_reference):
    with running_app({**PD_ARGS, "kv_transfer": "gloo"}) as base:
        yield base


@pytest.fixture(scope="module")
def http(url):
    with httpx.Client(base_url=url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(autouse=True)
def idle_after(http):
    yield
    wait_idle(http, timeout=180)  # the last test waits for a replacement replica


GREEDY = {"max_new_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}


def test_server_info_lists_both_roles(http):
    rs = wait_idle(http)
    assert sorted(r["role"] for r in rs) == ["decode", "prefill"]
    info = http.get("/get_server_info").json()
    assert info["pd"] is True and info["kv_transfer"] == "gloo"


def test_greedy_output_equals_unified(http, reference):
    ids, expected, _ = reference
    for prompt_ids, ref in zip(ids, expected):
        out = http.post("/generate", json={"input_ids": prompt_ids, "sampling_params": GREEDY}).json()
        assert out["output_ids"] == ref["output_ids"]
        assert out["text"] == ref["text"]
        meta = out["meta_info"]
        assert meta["prompt_tokens"] == len(prompt_ids) and meta["completion_tokens"] == MAX_TOKENS
        assert meta["finish_reason"]["type"] == "length"
    # Both sides really took part: the prefill replica sent the KV, the decode replica took it.
    stats = {r["role"]: r for r in http.get("/get_server_info").json()["replicas"]}
    assert stats["prefill"]["generation_tokens_total"] >= len(ids)
    assert stats["decode"]["generation_tokens_total"] >= len(ids) * (MAX_TOKENS - 1)


@pytest.mark.parametrize("k", range(len(PARITY_PARAMS)), ids=[str(p) for p in PARITY_PARAMS])
def test_pd_answers_as_unified_does(http, parity_reference, k):
    params = {**PARITY_PARAMS[k], "temperature": 0}
    r = http.post("/generate", json={"text": PARITY_PROMPT, "sampling_params": params})
    assert r.status_code == 200, r.text
    assert parity_answer(r.json()) == parity_reference[k]


def test_no_new_tokens_is_no_transfer(http):
    """Nothing to decode: a prefill replica answers it whole, as a unified one does. No decode
    reservation, no transfer (so no transfer to fail), the prompt cached on the prefill side."""
    before = {r["role"]: r for r in replicas(http)}
    params = {"max_new_tokens": 0, "temperature": 0}
    out = http.post("/generate", json={"text": PARITY_PROMPT + " more", "sampling_params": params}).json()
    assert (out["text"], out["meta_info"]["finish_reason"]["type"]) == ("", "length")
    after = {r["role"]: r for r in replicas(http)}
    assert after["prefill"]["num_requests_total"] == before["prefill"]["num_requests_total"] + 1
    assert after["decode"]["num_requests_total"] == before["decode"]["num_requests_total"]
    assert after["prefill"]["pd_bytes_sent_total"] == before["prefill"]["pd_bytes_sent_total"]
    assert after["decode"]["pd_bytes_received_total"] == before["decode"]["pd_bytes_received_total"]


def test_prompt_logprobs_come_from_the_prefill_side(http, reference):
    ids, expected, _ = reference
    body = {
        "input_ids": ids[0],
        "sampling_params": GREEDY,
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 2,
    }
    whole = http.post("/generate", json=body).json()
    meta = whole["meta_info"]
    assert whole["output_ids"] == expected[0]["output_ids"]
    assert [t for _, t, _ in meta["input_token_logprobs"]] == ids[0]
    assert meta["input_token_logprobs"][0][0] is None and len(meta["output_token_logprobs"]) == MAX_TOKENS
    assert all(len(top) == 2 for top in meta["input_top_logprobs"][1:])
    streamed = http.post("/generate", json={**body, "logprob_start_len": 2, "stream": True})
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    tail = events[-1]["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in tail] == ids[0][2:]
    assert [lp for lp, _, _ in tail] == pytest.approx(
        [lp for lp, _, _ in meta["input_token_logprobs"][2:]], abs=0.05
    )


def test_streaming_and_n_and_logprobs_through_openai(client, reference):
    ids, expected, _ = reference
    model = client.models.list().data[0].id
    chunks = list(
        client.completions.create(
            model=model, prompt=ids[0], max_tokens=MAX_TOKENS, temperature=0, stream=True, logprobs=1
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected[0]["text"]
    assert sum(len(c.choices[0].logprobs.tokens) for c in chunks if c.choices and c.choices[0].logprobs) == (
        MAX_TOKENS
    )
    out = client.completions.create(model=model, prompt=ids[1], max_tokens=MAX_TOKENS, temperature=0, n=2)
    assert [c.text for c in out.choices] == [expected[1]["text"]] * 2
    assert out.usage.completion_tokens == 2 * MAX_TOKENS


def test_stop_string_cuts_like_unified(client, reference):
    ids, expected, _ = reference
    full = expected[2]["text"]
    stop = full[len(full) // 2 :][:3]
    model = client.models.list().data[0].id
    for stream in (False, True):
        if stream:
            parts = client.completions.create(
                model=model, prompt=ids[2], max_tokens=MAX_TOKENS, temperature=0, stop=[stop], stream=True
            )
            text = "".join(c.choices[0].text for c in parts if c.choices)
        else:
            out = client.completions.create(
                model=model, prompt=ids[2], max_tokens=MAX_TOKENS, temperature=0, stop=[stop]
            )
            text = out.choices[0].text
            assert out.choices[0].finish_reason == "stop"
        assert text == full[: full.index(stop)]


def test_json_schema_in_pd(client):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    model = client.models.list().data[0].id
    out = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Give a person as JSON."}],
        max_tokens=48,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
    )
    value = json.loads(out.choices[0].message.content)
    assert isinstance(value["name"], str) and isinstance(value["age"], int)


def test_cached_tokens_reported_and_follow_up_moves_less(client, http):
    model = client.models.list().data[0].id
    system = "You are a terse assistant. " * 20
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Say hi."}]
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0)
    before = {r["role"]: r for r in replicas(http)}
    second = client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0)
    after = {r["role"]: r for r in replicas(http)}
    assert first.usage.prompt_tokens == second.usage.prompt_tokens > 100
    assert second.usage.prompt_tokens_details.cached_tokens >= second.usage.prompt_tokens - 1
    assert second.choices[0].message.content == first.choices[0].message.content
    # The prefill replica computed one token the second time; it was its cache that answered.
    assert after["prefill"]["computed_tokens_total"] - before["prefill"]["computed_tokens_total"] <= 2


def test_client_disconnect_frees_both_sides(http, reference):
    ids, _, _ = reference
    body = {
        "input_ids": ids[0],
        "sampling_params": {"max_new_tokens": 400, "ignore_eos": True},
        "stream": True,
    }
    with http.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = 0
        for line in lines:
            if line.startswith("data: {"):
                got += 1
                if got >= 3:  # the first token (prefill) and then decode's
                    break
    rs = wait_idle(http)
    decode = next(r for r in rs if r["role"] == "decode")
    assert decode["num_aborted_total"] >= 1


def test_decode_replica_lost_mid_stream_the_rest_is_recomputed(http, reference):
    """Last in the module: it kills the decode replica while two requests decode there. The
    client's stream goes on (the rest is recomputed on the prefill replica, resumed from the
    tokens sent) and equals the unified output. A constrained request with n = 2 is resumed the
    same way, its grammar replayed over what each sequence had: both still match the pattern
    whole. The prefill side frees everything; Serve replaces the decode replica."""
    ids, _, long = reference
    sp = {"max_new_tokens": LONG_TOKENS, "temperature": 0, "ignore_eos": True}
    body = {"input_ids": ids[0], "sampling_params": sp, "stream": True}
    words = "(alpha|beta|gamma)"
    pattern = f"{words}( {words}){{30}}"
    constrained = {"prompt": "Say some Greek letters:", "max_tokens": 200, "n": 2, "temperature": 0}
    events, killed = [], False
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(http.post, "/v1/completions", json={**constrained, "regex": pattern}, timeout=300)
        with http.stream("POST", "/generate", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[len("data: ") :]))
                    if len(events) == 4 and not killed:
                        in_flight = not fut.done()
                        kill_replica("DecodeReplica")
                        killed = True
        answer = fut.result()
    assert killed and in_flight
    assert answer.status_code == 200, answer.text
    choices = answer.json()["choices"]
    assert len(choices) == 2 and all(re.fullmatch(pattern, c["text"]) for c in choices), choices
    last = events[-1]
    assert last["output_ids"] == long["output_ids"]
    assert last["text"] == long["text"]
    meta = last["meta_info"]
    assert meta["prompt_tokens"] == len(ids[0]) and meta["completion_tokens"] == LONG_TOKENS
