"""The reasoning parsers (router/frontend/reasoning.py): the same split of thinking and answer
whatever the piece boundaries (every split point, every pair of split points, one character a
piece), for both conventions, and the thinking's token count."""

import itertools

import pytest

from radixserve.router.frontend.reasoning import Delta, ReasoningParser, ReasoningSplit, thinking_of
from radixserve.workers.protocol import REASONING_FORMATS

QWEN3, R1 = REASONING_FORMATS["qwen3"], REASONING_FORMATS["deepseek-r1"]

# (format, output, thinking, answer)
CASES = [
    (QWEN3, "<think>\nI add.\n</think>\n\n4", "\nI add.\n", "\n\n4"),
    (QWEN3, "<think></think>4", "", "4"),  # empty thinking
    (QWEN3, "4, no thinking", "", "4, no thinking"),  # enable_thinking false: no block at all
    (QWEN3, "<thin>k", "", "<thin>k"),  # a start tag's beginning that is not one
    (QWEN3, "<think>cut off </thi", "cut off </thi", ""),  # no end tag: all thinking
    (QWEN3, "<thi", "", "<thi"),  # the output ends inside what could have been the start tag
    (QWEN3, "a</think>b", "", "a</think>b"),  # qwen3's thinking must open the output
    (QWEN3, "<think>a</think>b</think>c", "a", "b</think>c"),  # the first end tag ends it
    (QWEN3, "<think>x<</think>y", "x<", "y"),
    (R1, "I add.</think>4", "I add.", "4"),
    (R1, "<think>I add.</think>4", "I add.", "4"),  # a start tag written anyway is dropped
    (R1, "</think>4", "", "4"),  # empty thinking
    (R1, "thinking that never ends </th", "thinking that never ends </th", ""),
    (R1, "<thi", "<thi", ""),
    (R1, "a </ </thin </think></think>", "a </ </thin ", "</think>"),
    (R1, "", "", ""),
]


def run(fmt, pieces):
    parser = ReasoningParser(fmt)
    out = [parser.feed(p) for p in pieces] + [parser.finish()]
    return "".join(d.reasoning for d in out), "".join(d.content for d in out)


@pytest.mark.parametrize("fmt, text, thinking, answer", CASES)
def test_every_split(fmt, text, thinking, answer):
    assert run(fmt, [text]) == (thinking, answer)
    assert run(fmt, list(text)) == (thinking, answer)
    for cuts in itertools.combinations(range(len(text) + 1), 2):
        pieces = [text[: cuts[0]], text[cuts[0] : cuts[1]], text[cuts[1] :]]
        assert run(fmt, pieces) == (thinking, answer), pieces


def test_the_end_tag_only_in_the_last_piece():
    parser = ReasoningParser(R1)
    assert parser.feed("long thought ") == Delta(reasoning="long thought ")
    assert parser.feed("</") == Delta()  # may be the end tag: held back
    assert parser.feed("think>{}") == Delta(content="{}")
    assert parser.answer_at == 6
    assert parser.finish() == Delta()


def test_held_text_that_turns_out_not_to_be_a_tag_is_released():
    parser = ReasoningParser(R1)
    assert parser.feed("a </thin") == Delta(reasoning="a ")
    assert parser.feed("gs") == Delta(reasoning="</things")
    parser = ReasoningParser(QWEN3)
    assert parser.feed("<th") == Delta()
    assert parser.feed("e answer") == Delta(content="<the answer")
    assert parser.answer_at == 0


def test_answer_at_counts_from_the_piece_fed():
    parser = ReasoningParser(QWEN3)
    parser.feed("<think>ab")
    assert parser.answer_at is None
    parser.feed("c</think>de")
    assert parser.answer_at == 9
    parser.feed("f")
    assert parser.answer_at is None  # already answering before this piece


TOKEN_TEXT = {1: "<think>", 2: "I", 3: " add", 4: "</", 5: "think", 6: ">", 7: "4", 8: "<", 9: "th", 10: ">{"}


def split(fmt, chunks):
    s = ReasoningSplit(fmt, TOKEN_TEXT.__getitem__)
    for k, ids in enumerate(chunks):
        s.add("".join(TOKEN_TEXT[t] for t in ids), ids, finished=k == len(chunks) - 1)
    return s


@pytest.mark.parametrize(
    "fmt, chunks, tokens, thinking, answer",
    [
        (QWEN3, [[1], [2], [3], [4], [5], [6], [7]], 6, "I add", "4"),
        (QWEN3, [[1, 2, 3, 4, 5, 6, 7]], 6, "I add", "4"),  # the answer begins inside a chunk
        (QWEN3, [[1, 2], [3, 4, 5], [10]], 6, "I add", "{"),  # inside a token's text
        (QWEN3, [[7], [2]], 0, "", "4I"),  # no thinking
        (QWEN3, [[8], [9], [7]], 0, "", "<th4"),  # the opening held back, then no thinking
        (QWEN3, [[8], [9]], 0, "", "<th"),
        (QWEN3, [[1, 2], [3]], 3, "I add", ""),  # cut off while thinking
        (R1, [[2], [3], [4, 5, 6], [7]], 5, "I add", "4"),
        (R1, [[8], [9], [2]], 3, "<thI", ""),  # an opening that was thinking after all
        (R1, [[4], [5], [6, 7]], 3, "", "4"),  # empty thinking: its end tag's tokens count
    ],
)
def test_reasoning_tokens(fmt, chunks, tokens, thinking, answer):
    s = split(fmt, chunks)
    assert (s.reasoning_tokens, s.reasoning, s.content) == (tokens, thinking, answer)


def test_chat_bodies_and_deltas_carry_the_thinking_apart():
    from radixserve.router.frontend.responses import Sequences
    from radixserve.workers.protocol import OutputChunk

    seqs = Sequences(1, 2, reasoning=lambda: ReasoningSplit(R1, TOKEN_TEXT.__getitem__))
    deltas = []
    for index, ids in [(0, [2, 3]), (1, [7]), (0, [4, 5]), (0, [6, 7]), (1, [4, 5, 6])]:
        text = "".join(TOKEN_TEXT[t] for t in ids)
        i = seqs.add(0, OutputChunk("r", index=index, token_ids=ids, text=text))
        deltas.append(seqs.choices[i].last_delta)
    seqs.add(0, OutputChunk("r", index=0, finished=True, prompt_tokens=3))
    seqs.add(0, OutputChunk("r", index=1, finished=True, prompt_tokens=3))
    assert deltas == [
        {"reasoning_content": "I add", "reasoning": "I add"},
        {"reasoning_content": "4", "reasoning": "4"},
        {},  # "</think" is held back: it may be the end tag
        {"content": "4"},
        {},  # the answer begins, empty
    ]
    assert [s.message_text() for s in seqs.choices] == [
        {"content": "4", "reasoning_content": "I add", "reasoning": "I add"},
        {"content": "", "reasoning_content": "4", "reasoning": "4"},
    ]
    usage = seqs.usage().to_dict()
    assert usage["completion_tokens"] == 10  # max_tokens counts thinking and answer together
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 5 + 4}
    plain = Sequences(1, 1)
    plain.add(0, OutputChunk("r", token_ids=[7], text="4", finished=True))
    assert plain.choices[0].message_text() == {"content": "4"}
    assert "completion_tokens_details" not in plain.usage().to_dict()


def test_a_request_that_turns_thinking_off_gets_no_room_for_it_in_its_grammar():
    assert thinking_of("qwen3", None) == "qwen3"
    assert thinking_of("qwen3", {"enable_thinking": True}) == "qwen3"
    assert thinking_of("qwen3", {"enable_thinking": False}) is None
    # deepseek-r1's template always opens the thinking: no switch turns it off
    assert thinking_of("deepseek-r1", {"enable_thinking": False}) == "deepseek-r1"
    assert thinking_of(None, {"enable_thinking": False}) is None
