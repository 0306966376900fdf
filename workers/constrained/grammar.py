"""One sequence's grammar state (`Grammar`), the bitmask applied to logits, and jump-forward."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar as xgr

from radixserve.workers.constrained.forced_text import JUMP_BYTES_PER_TOKEN, MAX_JUMP_BYTES, ForcedText


class Grammar:
    """One sequence's position in its grammar. Used from the engine thread only."""

    def __init__(
        self,
        matcher: xgr.GrammarMatcher,
        stop_token_ids: Sequence[int],
        vocab_size: int,
        forced: ForcedText,
    ):
        self._matcher = matcher
        self._stop_token_ids = tuple(stop_token_ids)
        self._vocab_size = vocab_size
        self._forced = forced

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar does not allow it."""
        return self._matcher.accept_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into bitmask[row]; only stop tokens once terminated."""
        if self._matcher.is_terminated():
            bitmask[row].zero_()
            for token_id in self._stop_token_ids:
                bitmask[row, token_id // 32] |= _bit(token_id % 32)
            return
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def allows_any_token(self) -> bool:
        """False at a dead end: nothing the grammar admits continues what it accepted so far (a
        rule with no way to end, such as `root ::= root "a"`, is one from the start)."""
        if self._matcher.is_terminated():
            return bool(self._stop_token_ids)
        bitmask = xgr.allocate_token_bitmask(1, self._vocab_size)
        self._matcher.fill_next_token_bitmask(bitmask, 0)
        return bool(bitmask.any())

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens (jump-forward retokenization, speculation)."""
        self._matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        """True once a stop token was accepted at an end of the grammar: the request is done."""
        return self._matcher.is_terminated()

    def jump_forward(self, max_bytes: int = MAX_JUMP_BYTES) -> str:
        """The text the grammar forces next, whatever the model would say ("" if none), at most
        `max_bytes` bytes of it (bounded: see forced_text)."""
        return self._forced.search(self._matcher, min(max_bytes, MAX_JUMP_BYTES))

    def copy(self) -> Grammar:
        """An independent matcher in the same state (for the n > 1 siblings of a request)."""
        return Grammar(self._matcher.fork(), self._stop_token_ids, self._vocab_size, self._forced)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None) -> None:
    """Set logits[r, t] = -inf where bitmask[r] disallows t, for r in rows (None: every row).

    bitmask row r belongs to logits row r; a longer (preallocated) bitmask is fine. Logit columns
    beyond the bitmask's width (vocab padding) are disallowed on the constrained rows.
    """
    if rows is not None and not rows:
        return
    bitmask = bitmask[: logits.shape[0]]
    width = bitmask.shape[-1] * 32
    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows, vocab_size=min(width, logits.shape[-1]))
    if logits.shape[-1] > width:
        logits[rows if rows is not None else slice(None), width:] = float("-inf")


def jump_forward_tokens(
    tokenizer, grammar: Grammar, last_token: int | None = None, max_tokens: int | None = None
) -> list[int]:
    """Tokens for the text the grammar forces next, accepted into `grammar`; [] if none. With
    `max_tokens` (what the request may still generate) at most that many, from a search of at
    most JUMP_BYTES_PER_TOKEN bytes per token.

    Boundaries are where a naive encode of the forced text goes wrong:
    - before it, the last generated token may merge with the text's first characters in the
      tokenizer's canonical encoding; the text is encoded after `last_token` and used only if that
      reproduces `last_token` (else the text alone is encoded: valid, just not canonical);
    - after it, the last forced token may merge with what the model writes next (` "` + `}`),
      so it is held back and left to ordinary sampling.
    A token the grammar rejects (a tokenizer that adds a prefix space, a special token spelled in
    the text) ends the jump there; the tokens before it stay accepted and are returned.
    """
    limit = MAX_JUMP_BYTES if max_tokens is None else max_tokens * JUMP_BYTES_PER_TOKEN
    text = grammar.jump_forward(limit)
    if not text:
        return []
    ids = _encode_after(tokenizer, text, last_token)[:-1]
    if max_tokens is not None:
        ids = ids[:max_tokens]
    special = set(tokenizer.all_special_ids)
    accepted: list[int] = []
    for token_id in ids:
        if token_id in special or not grammar.accept_token(token_id):
            break
        accepted.append(token_id)
    return accepted


def _encode_after(tokenizer, text: str, last_token: int | None) -> list[int]:
    if last_token is not None:
        joined = tokenizer.encode(tokenizer.decode([last_token]) + text, add_special_tokens=False)
        if joined and joined[0] == last_token:
            return joined[1:]
    return tokenizer.encode(text, add_special_tokens=False)


def _bit(index: int) -> int:
    return 1 << index if index < 31 else -(1 << 31)  # bit 31 is the int32 sign bit
