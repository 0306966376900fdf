"""Validates a GenerateRequest against this engine's limits and builds its n sequences.

Pure: it reads only what is fixed once the engine is built (vocabulary, context length, KV pool
size), so any thread may call it, and a refused request leaves no trace in the engine.
"""

from __future__ import annotations

from typing import Any

from radixserve.workers.engine.detokenizer import IncrementalDetokenizer
from radixserve.workers.engine.request import Req
from radixserve.workers.protocol import (
    GenerateRequest,
    InvalidRequest,
    check_context_length,
    check_logprob_start_len,
)
from radixserve.workers.sampling.sampler import Sampler


class RequestBuilder:
    def __init__(
        self, tokenizer: Any, sampler: Sampler, context_length: int, kv_pool_tokens: int, lora: bool = False
    ):
        self.lora = lora  # whether this engine serves LoRA adapters
        self.tokenizer = tokenizer
        self.sampler = sampler
        self.vocab_size = len(tokenizer)
        self.context_length = context_length
        self.kv_pool_tokens = kv_pool_tokens

    def build(self, request: GenerateRequest) -> list[Req]:
        """The request's sequences, ready for the engine thread to add; raises InvalidRequest."""
        ids, p = request.input_ids, request.sampling_params
        p.validate(self.vocab_size)
        if not ids:
            raise InvalidRequest("the prompt is empty", "prompt")
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size for t in ids):
            raise InvalidRequest(f"input_ids must be integers in [0, {self.vocab_size})", "input_ids")
        check_logprob_start_len(p.logprob_start_len, len(ids))
        check_context_length(len(ids), p.max_new_tokens, self.context_length)
        self._check_fits_kv_pool(len(ids), p.max_new_tokens)
        prefixes = self._output_prefix(request)
        namespace, lora = request.namespace, request.lora
        if lora is not None:
            if not self.lora:
                raise InvalidRequest(
                    "this server runs no LoRA adapters (start it with --enable-lora)", "lora"
                )
            namespace = lora.namespace(namespace)  # never a cache hit across adapters
        reqs = []
        for i in range(p.n):
            req = Req(request.rid, i, list(ids), p, namespace)
            req.lora = None if lora is None else (lora.name, lora.path)
            req.resume_ids = prefixes[i]
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, p.skip_special_tokens, p.stop)
            if p.seed is not None:
                req.generator = self.sampler.make_generator(p.seed + i)
            reqs.append(req)
        return reqs

    def _output_prefix(self, request: GenerateRequest) -> list[list[int]]:
        """Per sequence, the output tokens to resume from (GenerateRequest.output_prefix)."""
        p, prefix = request.sampling_params, request.output_prefix
        if prefix is None:
            return [[] for _ in range(p.n)]
        if request.kv_tickets is not None:
            raise InvalidRequest("a resumed request takes no KV tickets", "output_prefix")
        if not isinstance(prefix, list) or len(prefix) != p.n:
            raise InvalidRequest(f"output_prefix needs one token list per sequence ({p.n})", "output_prefix")
        for ids in prefix:
            if not isinstance(ids, list) or any(
                not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size for t in ids
            ):
                raise InvalidRequest(
                    f"output_prefix holds integers in [0, {self.vocab_size})", "output_prefix"
                )
            if len(ids) >= p.max_new_tokens:
                raise InvalidRequest("an output prefix leaves no token to generate", "output_prefix")
        return [list(ids) for ids in prefix]

    def _check_fits_kv_pool(self, prompt: int, max_new_tokens: int) -> None:
        """A sequence that cannot fit in the whole KV pool could never finish: refuse it now rather
        than let it run into the wall. At its longest a sequence holds the KV of its prompt and of
        every output token but the last (which is sampled, never fed back)."""
        size = self.kv_pool_tokens
        if prompt > size:
            raise InvalidRequest(
                f"the prompt ({prompt} tokens) does not fit in this replica's KV cache ({size} tokens)",
                "prompt",
                code="context_length_exceeded",
            )
        if prompt + max(max_new_tokens - 1, 0) > size:
            raise InvalidRequest(
                f"the prompt ({prompt} tokens) and the completion ({max_new_tokens} tokens) do not fit "
                f"in this replica's KV cache ({size} tokens); reduce the prompt or the completion length",
                "max_tokens",
                code="context_length_exceeded",
            )
