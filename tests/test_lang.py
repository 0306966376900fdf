"""The frontend language on the offline engine (the default model): role blocks as the chat
template writes them, gen and select against the engine's own answers, forks as one batch with
their preamble computed once, streaming, batches, errors, and the examples."""

from __future__ import annotations

import json

import pytest

import radixserve.lang as rl
from radixserve.lang.examples import agent, classify, extract_json, judge
from radixserve.workers import Engine
from tests.engine_utils import assert_kv_invariant, wait_idle

GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def engine():
    e = Engine(max_total_tokens=8192, max_running_requests=32)
    yield e
    e.shutdown()


@pytest.fixture
def backend(engine):
    yield rl.EngineBackend(engine)
    assert_kv_invariant(engine)


def computed(engine) -> int:
    wait_idle(engine)
    return engine.stats()["computed_tokens_total"]


@rl.function
def chat(s, question: str) -> None:
    s += rl.system("You answer in one short sentence.")
    s += rl.user(question)
    s += rl.assistant(rl.gen("answer", max_tokens=12))


def test_role_blocks_are_the_chat_template_and_gen_is_the_engines_greedy_answer(engine, backend):
    s = chat.run(question="What is the capital of France?", backend=backend, sampling=GREEDY)
    msgs = s.messages()
    assert [m["role"] for m in msgs] == ["system", "user", "assistant"]
    assert msgs[2]["content"] == s["answer"]
    tok = engine.tokenizer
    assert s.text() == tok.apply_chat_template(msgs, tokenize=False)
    prompt = tok.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True)
    direct = engine.generate(prompt, {"max_new_tokens": 12, "temperature": 0})
    assert s["answer"] == direct["text"] and s["answer"]
    (usage,) = s.meta("answer").usage
    assert usage.prompt_tokens == len(tok.encode(prompt))
    assert usage.completion_tokens == direct["meta_info"]["completion_tokens"]


def test_a_user_first_conversation_gets_the_templates_default_system_prompt(engine, backend):
    @rl.function
    def ask(s):
        s += rl.user("Hi") + rl.assistant("Hello.")

    s = ask.run(backend=backend)
    assert s.text() == engine.tokenizer.apply_chat_template(s.messages(), tokenize=False)
    assert "You are a helpful AI assistant" in s.text()


@rl.function
def sentiment(s, review: str, method=rl.token_length_normalized) -> None:
    s += f"Review: {review}\nSentiment: " + rl.select("label", ["positive", "negative"], method)


def _choice_logprobs(engine, prompt: str, choice: str) -> list[float]:
    """The choice's token logprobs after the prompt, from the engine's prompt logprobs."""
    tok = engine.tokenizer
    p, full = tok.encode(prompt), tok.encode(prompt + choice)
    k = 0
    while k < len(p) and p[k] == full[k]:
        k += 1
    out = engine.generate(
        prompt + choice, {"max_new_tokens": 0, "logprobs": True, "logprob_start_len": 0, "temperature": 0}
    )
    return [t[0] for t in out["meta_info"]["input_token_logprobs"][k:]]


def test_select_scores_are_the_mean_logprob_of_each_choices_tokens(engine, backend):
    review = "I loved every minute, a wonderful film."
    s = sentiment.run(review=review, backend=backend)
    prompt = f"Review: {review}\nSentiment: "
    expected = [
        sum(lps) / len(lps) for lps in (_choice_logprobs(engine, prompt, c) for c in ["positive", "negative"])
    ]
    assert s.meta("label").scores == pytest.approx(expected, abs=1e-4)
    assert s["label"] == ["positive", "negative"][expected.index(max(expected))]
    assert s.text() == prompt + s["label"]


def test_unconditional_select_subtracts_the_neutral_contexts_logprobs(engine, backend):
    review = "It arrived."
    s = sentiment.run(review=review, method=rl.unconditional_likelihood_normalized, backend=backend)
    prompt = f"Review: {review}\nSentiment: "
    expected = []
    for c in ["positive", "negative"]:
        cond = _choice_logprobs(engine, prompt, c)
        uncond = _choice_logprobs(engine, "Answer:", c)
        expected.append((sum(cond) - sum(uncond)) / len(cond))
    assert s.meta("label").scores == pytest.approx(expected, abs=1e-4)


PREAMBLE = (
    "You are reviewing a short essay about the history of the printing press, its spread across "
    "Europe in the fifteenth century, and what it changed for science, religion and trade."
)


@rl.function
def branches(s, dims: list[str]) -> list[str]:
    s += PREAMBLE
    forks = s.fork(len(dims))
    for f, d in zip(forks, dims):
        f += f" Judge its {d}:" + rl.gen("j", max_tokens=4)
    return forks.values("j")


def _common(a: list[int], b: list[int]) -> int:
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


def test_a_fork_runs_as_one_batch_and_computes_its_preamble_once(engine, backend):
    dims = ["clarity", "accuracy", "style"]
    ids = [engine.tokenizer.encode(PREAMBLE + f" Judge its {d}:") for d in dims]
    shared = [0] + [_common(ids[0], other) for other in ids[1:]]
    assert min(shared[1:]) > len(engine.tokenizer.encode(PREAMBLE)) - 2
    assert engine.flush_cache()
    before = computed(engine)
    s = branches.run(dims=dims, backend=backend, sampling=GREEDY)
    # Cold cache, one batch: the first branch computes its prompt, the others only what follows
    # the prefix they share with it (three independent cold requests would compute it thrice).
    assert computed(engine) - before == sum(len(p) for p in ids) - sum(shared)
    direct = engine.generate(
        [PREAMBLE + f" Judge its {d}:" for d in dims], [{"max_new_tokens": 4, **GREEDY}] * 3
    )
    assert s.ret == [d["text"] for d in direct]


def test_streamed_text_is_the_generated_text(backend):
    s = chat.run(question="Name a colour.", backend=backend, stream=True, sampling=GREEDY)
    pieces = list(s.text_iter("answer"))
    assert len(pieces) > 1 and "".join(pieces) == s["answer"]
    assert "".join(s.text_iter()) == s.text()


def test_run_batch_equals_single_runs_and_keeps_order(backend):
    reviews = ["Awful, it broke at once.", "Superb quality, I love it.", "Fine."]
    batch = sentiment.run_batch([{"review": r} for r in reviews], backend=backend, num_threads=3)
    assert [s["label"] for s in batch] == [sentiment.run(review=r, backend=backend)["label"] for r in reviews]


def test_errors_carry_the_servers_message(backend):
    @rl.function
    def bad(s):
        s += "x" + rl.gen("y", regex="(unclosed", max_tokens=4)

    with pytest.raises(rl.BackendError) as err:
        bad.run(backend=backend)
    assert err.value.status == 400 and "regex" in err.value.message
    out = bad.run_batch([{}, {}], backend=backend, return_exceptions=True)
    assert all(isinstance(e, rl.BackendError) for e in out)

    @rl.function
    def empty(s):
        s += rl.select("c", ["a", "b"])

    with pytest.raises(rl.LangError, match="prompt is empty"):
        empty.run(backend=backend)
    with pytest.raises(rl.LangError, match="no backend"):
        chat.run(question="?")


def test_examples_run_and_their_outputs_validate(backend):
    j = judge.main(backend)
    assert set(j["judgments"]) == set(judge.DIMENSIONS) and 1 <= j["score"] <= 10
    incident = extract_json.main(backend)
    assert extract_json.check(json.loads(json.dumps(incident))) == incident
    c = classify.main(backend)
    assert {c["single"], c["unconditional"], *c["batch"]} <= set(classify.LABELS) and len(c["batch"]) == 4
    a = agent.main(backend)
    assert a["trace"] and all(t["result"] == agent.TOOLS[t["tool"]](t["a"], t["b"]) for t in a["trace"])


def test_openai_style_scoring_takes_the_echoed_tokens_past_the_prompt_and_refuses_what_the_api_lacks():
    from radixserve.lang.openai_backend import _after, _fields

    echoed = {  # the echoed prompt + choice, then the one token generated after it
        "tokens": ["Sent", "iment", ":", " pos", "itive", "."],
        "text_offset": [0, 4, 9, 10, 14, 19],
        "token_logprobs": [None, -1.0, -0.5, -2.0, -0.25, -3.0],
    }
    assert _after(echoed, len("Sentiment:"), " positive") == [-2.0, -0.25]
    assert _after(echoed, len("Sentiment: "), "positive") == [-2.0, -0.25]  # " pos" crosses the boundary
    with pytest.raises(rl.LangError, match="adds no token"):
        _after(echoed, 20, "x")
    with pytest.raises(rl.LangError, match="no regex"):
        _fields(rl.Sampling.of(regex="a+"), chat=True)
    with pytest.raises(rl.LangError, match="on chat only"):
        _fields(rl.Sampling.of(json_schema={"type": "object"}), chat=False)
    assert _fields(rl.Sampling.of(max_tokens=3, stop="\n", json_schema={"type": "object"}), chat=True) == {
        "max_tokens": 3,
        "stop": ["\n"],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": {"type": "object"}, "strict": True},
        },
    }
