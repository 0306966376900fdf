"""How xgrammar sees the model's vocabulary (one TokenizerInfo per output language)."""

from __future__ import annotations

from collections.abc import Sequence

import xgrammar as xgr


def tokenizer_infos(
    tokenizer, vocab_size: int, stop_token_ids: Sequence[int], any_whitespace: bool
) -> tuple[xgr.TokenizerInfo, xgr.TokenizerInfo]:
    """xgrammar's view of the vocabulary: (for regex / EBNF, for JSON).

    Special tokens are never allowed as text: xgrammar would otherwise treat `<|im_start|>` as
    the literal text "<|im_start|>" and let it into a free string; a token with empty text is one
    it never allows. Ids in [len(tokenizer), vocab_size) (logit padding) are empty, hence never
    allowed, too. Stop tokens are allowed exactly where the grammar may end.

    For JSON, tokens holding a raw control character are removed as well: xgrammar 0.2.9 lets them
    into strings with minLength / maxLength (its character class there excludes only the quote,
    the backslash, CR and LF), which is not JSON.
    Without any_whitespace no control character is legal anywhere in the output.
    """
    detected = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
    )
    encoded = [""] * vocab_size
    for token, token_id in tokenizer.get_vocab().items():
        if token_id < vocab_size:
            encoded[token_id] = token
    special = set(tokenizer.all_special_ids)
    special.update(i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special)
    for token_id in special:
        if token_id < vocab_size:
            encoded[token_id] = ""
    whitespace = b"\t\n\r" if any_whitespace else b""
    control = bytes(b for b in range(32) if b not in whitespace)
    json_encoded = [
        token if token and not _has_any(text, control) else ""
        for token, text in zip(encoded, detected.decoded_vocab)
    ]

    def info(vocab: list[str]) -> xgr.TokenizerInfo:
        return xgr.TokenizerInfo(
            vocab,
            vocab_type=detected.vocab_type,
            vocab_size=vocab_size,
            stop_token_ids=list(stop_token_ids),
            add_prefix_space=detected.add_prefix_space,
        )

    return info(encoded), info(json_encoded)


def _has_any(text: bytes, chars: bytes) -> bool:
    return any(c in chars for c in text)
