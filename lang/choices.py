"""How `select` picks a choice from the prompt logprobs of each."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(frozen=True)
class ChoiceLogprobs:
    """One choice's tokens' logprobs after the prompt, and (when the method asks) after the
    method's neutral context."""

    conditional: list[float]
    unconditional: list[float] | None = None


class ChoicesMethod(ABC):
    """Scores each choice; the highest score wins (the first on a tie)."""

    unconditional_context: str | None = None  # the neutral context, for methods that need one

    @abstractmethod
    def scores(self, logprobs: list[ChoiceLogprobs]) -> list[float]: ...

    def decide(self, logprobs: list[ChoiceLogprobs]) -> tuple[int, list[float]]:
        scores = self.scores(logprobs)
        return max(range(len(scores)), key=lambda i: (scores[i], -i)), scores


class TokenLengthNormalized(ChoicesMethod):
    """SGLang's default: the mean logprob of the choice's tokens."""

    def scores(self, logprobs: list[ChoiceLogprobs]) -> list[float]:
        return [sum(c.conditional) / len(c.conditional) for c in logprobs]


class UnconditionalLikelihoodNormalized(ChoicesMethod):
    """The choice's logprob after the prompt less its logprob after a neutral context
    ("Answer:" by default), per token of the choice: favours the choice the prompt makes more
    likely, not the one likely anyway."""

    def __init__(self, context: str = "Answer:"):
        self.unconditional_context = context

    def scores(self, logprobs: list[ChoiceLogprobs]) -> list[float]:
        out = []
        for c in logprobs:
            assert c.unconditional is not None
            out.append((sum(c.conditional) - sum(c.unconditional)) / len(c.conditional))
        return out


token_length_normalized = TokenLengthNormalized()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
