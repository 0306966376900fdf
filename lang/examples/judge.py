"""One answer judged along several dimensions in parallel forks, then summarised and scored.

The forks share the conversation so far: their three judgments go to the server as one batch,
and the conversation is computed once for all three."""

from __future__ import annotations

from typing import Any

import radixserve.lang as rl

DIMENSIONS = ("accuracy", "clarity", "completeness")


@rl.function
def judge(s: rl.ProgramState, question: str, answer: str) -> dict[str, str]:
    s += rl.system("You are a careful reviewer of answers.")
    s += rl.user(f"Question: {question}\nAnswer: {answer}\nRead the answer.")
    s += rl.assistant("I have read the answer.")
    forks = s.fork(len(DIMENSIONS))
    for f, dim in zip(forks, DIMENSIONS):
        f += rl.user(f"In one sentence, judge the {dim} of the answer.")
        f += rl.assistant(rl.gen("judgment", max_tokens=40, stop="\n"))
    notes = "\n".join(f"- {dim}: {f['judgment']}" for dim, f in zip(DIMENSIONS, forks))
    s += rl.user(f"Your judgments:\n{notes}\nSummarise them in one sentence.")
    s += rl.assistant(rl.gen("summary", max_tokens=48, stop="\n"))
    s += rl.user("Score the answer from 1 to 10.")
    s += rl.assistant("Score: " + rl.gen("score", regex="(10|[1-9])"))
    return {dim: f["judgment"] for dim, f in zip(DIMENSIONS, forks)}


def main(backend: rl.Backend) -> dict[str, Any]:
    s = judge.run(
        question="Why is the sky blue?",
        answer="Sunlight scatters off air molecules, and blue light scatters the most.",
        backend=backend,
        sampling={"temperature": 0},
    )
    return {"judgments": s.ret, "summary": s["summary"], "score": int(s["score"])}


if __name__ == "__main__":
    from radixserve.lang.examples.backends import run_example

    run_example(main, __doc__)
