"""When a streaming sequence's chunks leave the engine: the first at once, the next no sooner than
`stream_interval_s` after the previous one (the tokens in between together), the final always."""

from __future__ import annotations

import pytest

from radixserve.workers.engine import output_processor
from radixserve.workers.engine.detokenizer import IncrementalDetokenizer
from radixserve.workers.engine.output_processor import OutputProcessor
from radixserve.workers.engine.request import Req
from radixserve.workers.protocol import SamplingParams
from tests.test_detokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def run(tok, monkeypatch, interval_s: float, gaps: list[float], stream_interval: int = 1):
    """Feed one token per step, `gaps[i]` seconds after the step before; the chunks taken after
    each step as (step, token count, finished)."""
    clock = Clock()
    monkeypatch.setattr(output_processor.time, "monotonic", clock)
    prompt = tok.encode("<|im_start|>user\nCount.<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode(" one two three four five six seven eight")[: len(gaps)]
    req = Req("r", 0, prompt, SamplingParams(max_new_tokens=len(ids), ignore_eos=True))
    req.detokenizer = IncrementalDetokenizer(tok, prompt)
    outputs = OutputProcessor(
        tok, [tok.eos_token_id], 2048, stream_interval=stream_interval, stream_interval_s=interval_s
    )
    chunks, text = [], ""
    for step, (token, gap) in enumerate(zip(ids, gaps)):
        clock.now += gap
        outputs.append_sampled(req, token, None)
        chunk = outputs.take_chunk(req)
        if chunk is not None:
            chunks.append((step, len(chunk.token_ids), chunk.finished))
            text += chunk.text
    assert text == tok.decode(ids)  # nothing lost or repeated, whatever the grouping
    return chunks


def test_every_token_without_an_interval(tok, monkeypatch):
    chunks = run(tok, monkeypatch, 0.0, [0.02] * 5)
    assert chunks == [(0, 1, False), (1, 1, False), (2, 1, False), (3, 1, False), (4, 1, True)]


def test_steps_faster_than_the_interval_share_a_chunk(tok, monkeypatch):
    # steps 20 ms apart, 50 ms interval: the first at once, then every third step, the final at once
    chunks = run(tok, monkeypatch, 0.05, [0.02] * 8)
    assert chunks == [(0, 1, False), (3, 3, False), (6, 3, False), (7, 1, True)]


def test_steps_slower_than_the_interval_go_one_by_one(tok, monkeypatch):
    chunks = run(tok, monkeypatch, 0.05, [0.06] * 4)
    assert chunks == [(0, 1, False), (1, 1, False), (2, 1, False), (3, 1, True)]


def test_token_interval_and_time_interval_both_hold(tok, monkeypatch):
    # every 2 tokens, and 50 ms apart: step 1 has 2 tokens but only 20 ms since step 0's chunk
    chunks = run(tok, monkeypatch, 0.05, [0.02] * 7, stream_interval=2)
    assert chunks == [(1, 2, False), (4, 3, False), (6, 2, True)]
