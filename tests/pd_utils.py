"""Helpers for the live PD tests: the server's replicas by role, the idle invariant on both
pools, and the unified engine's greedy reference for the same prompts."""

from __future__ import annotations

import time

PD_ARGS = {
    "pd": True,
    "prefill_num_cpus": 1,
    "decode_num_cpus": 1,
    "num_threads": 1,
    "dtype": "float32",
    "max_total_tokens": 4096,
    "kv_transfer_timeout_s": 30,
    "router_sync_interval_s": 1,
}
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Here is a list of fruits: apple, banana,",
]
MAX_TOKENS = 12


LONG_TOKENS = 64
# Valid sampling parameter sets on which a PD server answers as a unified one does: greedy (so the
# tokens depend on the prompt alone), over the parameters whose handling differs between the two
# paths: no token at all, one token (all on the prefill side), stop strings, a grammar (one that
# forces its continuation forever among them), logprobs, n, biases, penalties, minimum lengths.
PARITY_PARAMS = [
    {"max_new_tokens": 0},
    {"max_new_tokens": 1},
    {"max_new_tokens": 10, "stop": [" and", "\n"]},
    {"max_new_tokens": 6, "logprobs": True, "top_logprobs": 2},
    {"max_new_tokens": 6, "n": 2},
    {"max_new_tokens": 6, "logit_bias": {"28": -100, "253": -100}},
    {"max_new_tokens": 6, "repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.5},
    {"max_new_tokens": 6, "min_new_tokens": 6},
    {"max_new_tokens": 10, "regex": "(yes|no), [a-z]+"},
    {"max_new_tokens": 12, "ebnf": 'root ::= "a" root'},
]


def parity_answer(out: dict | list) -> list[tuple]:
    """What must be equal between PD and unified answers (logprob values are compared by their
    tokens: the two paths compute them in different kernels)."""
    outs = out if isinstance(out, list) else [out]
    return [
        (
            o["text"],
            o["output_ids"],
            o["meta_info"]["finish_reason"],
            o["meta_info"]["completion_tokens"],
            [t[1] for t in o["meta_info"].get("output_token_logprobs") or []],
        )
        for o in outs
    ]


def unified_answers(prompt: str, params: list[dict]) -> list[list[tuple]]:
    """The unified engine's parity_answer for `prompt` under each parameter set (greedy)."""
    from radixserve.workers import Engine

    engine = Engine(dtype="float32", num_threads=1, max_total_tokens=4096)
    try:
        return [parity_answer(engine.generate(prompt, {**p, "temperature": 0})) for p in params]
    finally:
        engine.shutdown()


def unified_reference(prompts: list[str]) -> tuple[list[list[int]], list[dict], dict]:
    """Token ids of each prompt, the unified engine's greedy output for each (MAX_TOKENS long,
    same dtype and thread count as the PD replicas), and the first prompt's LONG_TOKENS one."""
    from radixserve.workers import Engine

    engine = Engine(dtype="float32", num_threads=1, max_total_tokens=4096)
    try:
        ids = [engine.tokenizer.encode(p) for p in prompts]
        params = {"max_new_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        outs = [engine.generate(input_ids=i, sampling_params=params) for i in ids]
        long = engine.generate(input_ids=ids[0], sampling_params={**params, "max_new_tokens": LONG_TOKENS})
        return ids, outs, long
    finally:
        engine.shutdown()


def kill_replica(role_deployment: str) -> None:
    """Kill the Serve replica actor of a deployment ("DecodeReplica", "PrefillReplica"); Serve
    starts a replacement."""
    import ray

    (actor,) = [
        a for a in ray.util.list_named_actors(all_namespaces=True) if f"#{role_deployment}#" in a["name"]
    ]
    ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)


def replicas(http) -> list[dict]:
    """Every engine replica's stats; [] while Serve's proxy refuses the app (a pool without a
    live replica, until its replacement is up)."""
    r = http.get("/get_server_info")
    return r.json()["replicas"] if r.status_code == 200 else []


def wait_idle(http, kv_total: int = 4096, timeout: float = 30.0, roles=("prefill", "decode")) -> list[dict]:
    """Both pools at the idle invariant: nothing running, queued or protected, every slot free or
    evictable, no transfer open."""
    deadline = time.monotonic() + timeout
    while True:
        rs = replicas(http)
        idle = sorted(r["role"] for r in rs) == sorted(roles) and all(
            r["running"] == 0
            and r["queued"] == 0
            and r["kv_protected"] == 0
            and r["kv_free"] + r["kv_evictable"] == r["kv_total"] == kv_total
            for r in rs
        )
        if idle:
            return rs
        assert time.monotonic() < deadline, f"not idle after {timeout}s: {rs}"
        time.sleep(0.1)
