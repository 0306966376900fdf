"""A few-shot sentiment classifier: the model selects a label by its logprobs; a batch of
reviews runs with `run_batch`, the few-shot preamble computed once for all of them."""

from __future__ import annotations

from typing import Any

import radixserve.lang as rl

LABELS = ["positive", "negative", "neutral"]
SHOTS = [
    ("The battery died after one day and support never answered.", "negative"),
    ("Arrived early, works perfectly, I would buy it again.", "positive"),
    ("It is a phone case. It fits the phone.", "neutral"),
    ("Terrible sound, the left earbud broke within a week.", "negative"),
    ("Absolutely love it, the colours are gorgeous.", "positive"),
]
REVIEWS = [
    "Wonderful product, exceeded every expectation.",
    "Broken on arrival and the refund took a month.",
    "The box contained the cable described.",
    "Great value, my kids adore it.",
]


@rl.function
def classify(s: rl.ProgramState, review: str, method: rl.ChoicesMethod = rl.token_length_normalized) -> None:
    s += "Classify the sentiment of each review as positive, negative or neutral.\n\n"
    for text, label in SHOTS:
        s += f"Review: {text}\nSentiment: {label}\n\n"
    s += f"Review: {review}\nSentiment: " + rl.select("label", LABELS, method)


def main(backend: rl.Backend) -> dict[str, Any]:
    one = classify.run(review=REVIEWS[0], backend=backend)
    batch = classify.run_batch([{"review": r} for r in REVIEWS], backend=backend, num_threads=4)
    uncond = classify.run(review=REVIEWS[1], method=rl.unconditional_likelihood_normalized, backend=backend)
    return {
        "single": one["label"],
        "scores": one.meta("label").scores,
        "batch": [s["label"] for s in batch],
        "unconditional": uncond["label"],
    }


if __name__ == "__main__":
    from radixserve.lang.examples.backends import run_example

    run_example(main, __doc__)
