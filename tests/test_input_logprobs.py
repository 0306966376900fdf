"""Prompt (input) logprobs computed in the prefill's forward, on the default model
(SmolLM2-135M-Instruct), against transformers' float32 logits: whole and chunked prefills, a partly
cached prompt, start positions 0 / middle / last, alternatives, and the per-step row budget."""

import asyncio

import pytest
import torch

from radixserve.workers import Engine
from radixserve.workers.engine import scheduler as scheduler_module
from radixserve.workers.protocol import GenerateRequest, InvalidRequest, SamplingParams
from tests.engine_utils import assert_kv_invariant

PROMPT = (
    "The quick brown fox jumps over the lazy dog. Then it runs into the forest, where it meets "
    "an old owl who tells it a story about the river and the mountains."
)
TOP = 3


@pytest.fixture(scope="module")
def engine():
    e = Engine(dtype="float32", max_total_tokens=4096, chunked_prefill_size=16)
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def ids(engine):
    out = engine.tokenizer.encode(PROMPT)
    assert len(out) > 2 * 16  # longer than two chunks
    return out


@pytest.fixture(scope="module")
def hf_logprobs(engine, ids):
    """transformers' float32 log-softmax at every prompt position: [len, vocab]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(engine.core.model_path, torch_dtype=torch.float32)
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].float()
    return logits.log_softmax(-1)


@pytest.fixture(autouse=True)
def invariant(request):
    yield
    if "engine" in request.fixturenames:
        assert_kv_invariant(request.getfixturevalue("engine"))


def _params(start: int, **kw) -> dict:
    return {"max_new_tokens": 4, "temperature": 0, "logprob_start_len": start, "top_logprobs": TOP, **kw}


def _check(meta: dict, ids: list[int], start: int, ref: torch.Tensor, tol: float) -> None:
    triples, tops = meta["input_token_logprobs"], meta["input_top_logprobs"]
    assert [t for _, t, _ in triples] == ids[start:]
    assert len(tops) == len(ids) - start
    for j, ((lp, tok, text), top) in enumerate(zip(triples, tops)):
        q = start + j
        assert isinstance(text, str)
        if q == 0:
            assert lp is None and top is None  # nothing predicts the first token
            continue
        assert abs(lp - ref[q - 1, tok].item()) < tol, (q, lp, ref[q - 1, tok].item())
        values, best = ref[q - 1].topk(TOP)
        assert [t for _, t, _ in top] == best.tolist()
        assert all(abs(v - w) < tol for (v, _, _), w in zip(top, values.tolist()))


@pytest.mark.parametrize("start", [0, 20, -2])
def test_prompt_logprobs_match_transformers_across_chunks(engine, ids, hf_logprobs, start):
    start = start % len(ids)  # -2: the last position but one; below, len - 1
    engine.flush_cache()
    out = engine.generate(input_ids=ids, sampling_params=_params(start))
    _check(out["meta_info"], ids, start, hf_logprobs, 1e-4)
    assert out["meta_info"]["cached_tokens"] == 0


def test_the_last_prompt_token_alone(engine, ids, hf_logprobs):
    start = len(ids) - 1
    out = engine.generate(input_ids=ids, sampling_params=_params(start))
    _check(out["meta_info"], ids, start, hf_logprobs, 1e-4)
    assert len(out["meta_info"]["input_token_logprobs"]) == 1


def test_a_cached_prompt_reuses_only_what_precedes_the_logprobs(engine, ids, hf_logprobs):
    engine.flush_cache()
    plain = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 4, "temperature": 0})
    assert "input_token_logprobs" not in plain["meta_info"]
    start = 25
    out = engine.generate(input_ids=ids, sampling_params=_params(start))
    # The reuse stops at start - 1, the first position whose logits the logprobs need.
    assert out["meta_info"]["cached_tokens"] == start - 1
    _check(out["meta_info"], ids, start, hf_logprobs, 1e-4)
    # Greedy output does not change for asking.
    assert out["output_ids"] == plain["output_ids"]
    again = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 4, "temperature": 0})
    assert again["output_ids"] == plain["output_ids"]
    assert again["meta_info"]["cached_tokens"] == len(ids) - 1


def test_no_new_tokens_still_gives_the_prompt_logprobs(engine, ids, hf_logprobs):
    out = engine.generate(input_ids=ids, sampling_params=_params(0, max_new_tokens=0))
    assert out["output_ids"] == []
    _check(out["meta_info"], ids, 0, hf_logprobs, 1e-4)


def test_rows_per_step_stay_within_the_budget(engine, ids, hf_logprobs, monkeypatch):
    """A budget of 5 rows chunks the prefill further than the chunk size does; the values hold."""
    monkeypatch.setattr(scheduler_module, "MAX_INPUT_LOGPROB_ROWS", 5)
    seen: list[int] = []
    prepare = engine.core.worker.prepare

    def spy(plan, bitmask):
        seen.append(plan.input_logprob_rows)
        return prepare(plan, bitmask)

    monkeypatch.setattr(engine.core.worker, "prepare", spy)
    engine.flush_cache()
    batch = engine.generate(input_ids=[ids, ids[:20]], sampling_params=[_params(0), _params(3)])
    assert max(seen) == 5 and sum(seen) == (len(ids) - 1) + (20 - 3)
    _check(batch[0]["meta_info"], ids, 0, hf_logprobs, 1e-4)
    _check(batch[1]["meta_info"], ids[:20], 3, hf_logprobs, 1e-4)


def test_streaming_sends_them_with_the_first_chunk_only(engine, ids):
    async def chunks():
        request = GenerateRequest(input_ids=ids, sampling_params=SamplingParams(**_params(5)), stream=True)
        return [c async for c in engine.submit(request)]

    got = asyncio.run(chunks())
    assert got[0].input_logprobs is not None and len(got[0].input_logprobs) == len(ids) - 5
    assert all(c.input_logprobs is None for c in got[1:])
    assert len(got) > 1


def test_bad_start_positions_are_refused(engine, ids):
    with pytest.raises(InvalidRequest, match="logprob_start_len"):
        engine.generate(input_ids=ids, sampling_params=_params(len(ids)))
    with pytest.raises(InvalidRequest, match="logprob_start_len"):
        engine.generate(input_ids=ids, sampling_params=_params(-2))


def test_bf16_engine_within_its_tolerance(ids, hf_logprobs):
    e = Engine(dtype="bfloat16", max_total_tokens=1024, chunked_prefill_size=16)
    try:
        out = e.generate(input_ids=ids, sampling_params=_params(0))
        triples = out["meta_info"]["input_token_logprobs"]
        pairs = [(lp, hf_logprobs[q - 1, tok].item()) for q, (lp, tok, _) in enumerate(triples) if q]
        # bf16 keeps 8 bits of mantissa (~0.4% per rounding, over 30 layers): each logprob within
        # half a nat, and on average within a few hundredths.
        for lp, ref in pairs:
            assert abs(lp - ref) <= 0.5, (lp, ref)
        assert sum(abs(lp - ref) for lp, ref in pairs) / len(pairs) < 0.05
        assert_kv_invariant(e)
    finally:
        e.shutdown()
