"""What the two backends of SGLang's native API share: gen calls as one batch `/generate`, and
select's scoring from prompt logprobs.

Scoring a choice takes two batches. The first sends each prompt alone with no new tokens: it
counts the prompt's tokens, and puts the prompt in the radix cache once for all its choices.
The second sends the prompt and each prompt + choice with their logprobs from a few tokens
before the prompt's end (the cache is reused up to there): a choice's tokens are those after
the first position where its ids part from the prompt's, so a choice that merges with the
prompt's last token into one token is scored from that token on."""

from __future__ import annotations

from abc import abstractmethod
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from radixserve.lang.backend import Backend, OnDelta
from radixserve.lang.calls import GenCall, GenResult, ScoreCall, ScoreResult, Usage
from radixserve.lang.choices import ChoiceLogprobs
from radixserve.lang.errors import LangError

# How many of the prompt's last tokens the second batch recomputes (a choice's first token may
# merge with them).
BOUNDARY_TOKENS = 3
_NO_TOKENS = {"max_new_tokens": 0, "temperature": 0.0}


class NativeBackend(Backend):
    """Subclasses send one native batch: `native(texts, params, logprob_start_len, on_delta)`
    returns one native result dict per text (`text`, `meta_info` with `prompt_tokens`,
    `cached_tokens`, and `input_token_logprobs` when `logprob_start_len` is not None)."""

    @abstractmethod
    def native(
        self,
        texts: list[str],
        params: list[dict[str, Any]],
        logprob_start_len: int | None = None,
        on_delta: OnDelta | None = None,
    ) -> list[dict[str, Any]]: ...

    def generate(self, calls: list[GenCall], on_delta: OnDelta | None = None) -> list[GenResult]:
        outs = self.native([c.prompt for c in calls], [c.sampling.native() for c in calls], None, on_delta)
        return [GenResult(o["text"], Usage.of_native(o["meta_info"])) for o in outs]

    def score(self, calls: list[ScoreCall]) -> list[ScoreResult]:
        prompts = []  # every distinct text the choices follow: the prompts, the neutral contexts
        for c in calls:
            prompts.append(c.prompt)
            if c.unconditional_context is not None:
                prompts.append(c.unconditional_context)
        if any(not p for p in prompts):
            raise LangError("select needs text before it: the prompt is empty")
        unique = list(dict.fromkeys(prompts))
        counted = self.native(unique, [_NO_TOKENS] * len(unique))
        lengths = {p: int(o["meta_info"]["prompt_tokens"]) for p, o in zip(unique, counted)}
        by_start: dict[int, list[str]] = {}
        for p in unique:
            by_start.setdefault(max(lengths[p] - BOUNDARY_TOKENS, 0), []).append(p)
        jobs = []
        for start, group in by_start.items():
            texts = [t for p in group for t in (p, *(p + ch for ch in _choices_after(calls, p)))]
            jobs.append((start, texts))
        with ThreadPoolExecutor(max_workers=max(1, len(jobs))) as pool:
            answers = list(pool.map(lambda j: self.native(j[1], [_NO_TOKENS] * len(j[1]), j[0]), jobs))
        windows: dict[str, list[list[Any]]] = {}
        usage: dict[str, Usage] = {}
        for (_, texts), outs in zip(jobs, answers):
            for t, o in zip(texts, outs):
                windows[t] = o["meta_info"]["input_token_logprobs"]
                usage[t] = Usage.of_native(o["meta_info"])
        results = []
        for c in calls:
            cond = [_choice_logprobs(windows[c.prompt], windows[c.prompt + ch], ch) for ch in c.choices]
            ctx = c.unconditional_context
            uncond = (
                [None] * len(c.choices)
                if ctx is None
                else [_choice_logprobs(windows[ctx], windows[ctx + ch], ch) for ch in c.choices]
            )
            texts = [c.prompt, *(c.prompt + ch for ch in c.choices)]
            results.append(
                ScoreResult([ChoiceLogprobs(a, b) for a, b in zip(cond, uncond)], [usage[t] for t in texts])
            )
        return results


def _choices_after(calls: list[ScoreCall], prefix: str) -> list[str]:
    """The choices scored after `prefix` (as a prompt or as a neutral context), each once."""
    out: dict[str, None] = {}
    for c in calls:
        if prefix in (c.prompt, c.unconditional_context):
            out.update(dict.fromkeys(c.choices))
    return list(out)


def _choice_logprobs(
    prompt_window: list[list[Any]], full_window: list[list[Any]], choice: str
) -> list[float]:
    """The logprobs of the tokens where the prompt + choice's ids part from the prompt's."""
    k = 0
    while k < len(prompt_window) and k < len(full_window) and prompt_window[k][1] == full_window[k][1]:
        k += 1
    picked = [t[0] for t in full_window[k:]]
    if not picked or any(lp is None for lp in picked):
        raise LangError(f"the choice {choice!r} adds no token the model can score after this prompt")
    return [float(lp) for lp in picked]
