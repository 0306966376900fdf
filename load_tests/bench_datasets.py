"""Workloads for bench_serving: `random`, `generated-shared-prefix`, `multi-turn`.

Prompts are built from a fixed word list so that any OpenAI-compatible server can be measured
without a local tokenizer; one word is about one token for common BPE vocabularies, and the
token counts that matter are the ones the server reports in `usage`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

WORDS = (
    "time person year way day thing man world life hand part child eye woman place work week "
    "case point company number group problem fact water room money story month lot right "
    "study book word business issue side kind head house service friend father power hour "
    "game line end member law car city name team minute idea kid body information back "
    "parent face others level office door health art war history party result change "
    "morning reason research girl guy moment air teacher force education river garden "
    "music window table paper market light voice field song planet ocean bridge engine "
    "signal winter summer forest island mountain letter picture question answer"
).split()


@dataclass
class Turn:
    """One request: chat messages so far (the last is the user's), and its output length."""

    messages: list[dict[str, str]]
    output_len: int


@dataclass
class Conversation:
    """Requests sent one after another; later turns carry the earlier answers when `chained`."""

    turns: list[Turn]
    chained: bool = False
    group: int | None = None
    history: list[dict[str, str]] = field(default_factory=list)


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(n, 1)))


def random_dataset(
    num_prompts: int, input_len: int, output_len: int, range_ratio: float, seed: int
) -> list[Conversation]:
    """Unrelated prompts: lengths uniform in [ratio * len, len]."""
    rng = random.Random(seed)

    def length(n: int) -> int:
        return rng.randint(max(1, int(n * range_ratio)), n)

    return [
        Conversation(
            [
                Turn(
                    [{"role": "user", "content": f"{i}: " + words(rng, length(input_len))}],
                    length(output_len),
                )
            ]
        )
        for i in range(num_prompts)
    ]


def shared_prefix_dataset(
    num_groups: int,
    prompts_per_group: int,
    system_prompt_len: int,
    question_len: int,
    output_len: int,
    seed: int,
) -> list[Conversation]:
    """Groups of requests that share one long system prompt (SGLang's generated-shared-prefix),
    interleaved across groups as real traffic would be."""
    rng = random.Random(seed)
    systems = [f"System prompt {g}. " + words(rng, system_prompt_len) for g in range(num_groups)]
    convs = [
        Conversation(
            [
                Turn(
                    [
                        {"role": "system", "content": systems[g]},
                        {"role": "user", "content": f"Q{g}.{q}: " + words(rng, question_len)},
                    ],
                    output_len,
                )
            ],
            group=g,
        )
        for g in range(num_groups)
        for q in range(prompts_per_group)
    ]
    rng.shuffle(convs)
    return convs


def multi_turn_dataset(
    num_conversations: int, turns: int, input_len: int, output_len: int, seed: int
) -> list[Conversation]:
    """Conversations of `turns` user messages; each turn resends the whole history."""
    rng = random.Random(seed)
    return [
        Conversation(
            [
                Turn([{"role": "user", "content": f"C{c}.{t}: " + words(rng, input_len)}], output_len)
                for t in range(turns)
            ],
            chained=True,
        )
        for c in range(num_conversations)
    ]


def build(args) -> list[Conversation]:
    if args.dataset == "random":
        return random_dataset(
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.seed,
        )
    if args.dataset == "generated-shared-prefix":
        return shared_prefix_dataset(
            args.gsp_num_groups,
            args.gsp_prompts_per_group,
            args.gsp_system_prompt_len,
            args.gsp_question_len,
            args.gsp_output_len,
            args.seed,
        )
    if args.dataset == "multi-turn":
        return multi_turn_dataset(
            args.num_prompts,
            args.multi_turn_turns,
            args.multi_turn_input_len,
            args.multi_turn_output_len,
            args.seed,
        )
    raise ValueError(f"unknown dataset {args.dataset!r}")
