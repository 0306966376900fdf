"""The frontend language: prompts written as programs.

import radixserve.lang as rl

@rl.function
def qa(s, question):
    s += rl.user(question)
    s += rl.assistant(rl.gen("answer", max_tokens=64))

rl.set_default_backend(rl.RuntimeEndpoint("http://127.0.0.1:30000"))
print(qa.run(question="Why is the sky blue?")["answer"])
"""

from __future__ import annotations

from typing import Any

from radixserve.lang.backend import Backend, default_backend, set_default_backend
from radixserve.lang.choices import (
    ChoicesMethod,
    TokenLengthNormalized,
    UnconditionalLikelihoodNormalized,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from radixserve.lang.errors import BackendError, LangError
from radixserve.lang.expr import assistant, system, user
from radixserve.lang.fork import Fork
from radixserve.lang.function import Function, function
from radixserve.lang.gen import gen
from radixserve.lang.openai_backend import OpenAI
from radixserve.lang.runtime_endpoint import RuntimeEndpoint
from radixserve.lang.sampling import Sampling
from radixserve.lang.select import select
from radixserve.lang.state import ProgramState

__all__ = [
    "Backend",
    "BackendError",
    "ChoicesMethod",
    "EngineBackend",
    "Fork",
    "Function",
    "LangError",
    "OpenAI",
    "ProgramState",
    "RuntimeEndpoint",
    "Sampling",
    "TokenLengthNormalized",
    "UnconditionalLikelihoodNormalized",
    "assistant",
    "default_backend",
    "function",
    "gen",
    "select",
    "set_default_backend",
    "system",
    "token_length_normalized",
    "unconditional_likelihood_normalized",
    "user",
]


def __getattr__(name: str) -> Any:
    # The offline backend imports the engine (torch and the model code): only when asked for.
    if name == "EngineBackend":
        from radixserve.lang.engine_backend import EngineBackend

        return EngineBackend
    raise AttributeError(name)
