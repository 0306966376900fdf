"""A grammar that lets a reasoning model think freely, then constrains only its answer.

The thinking is any text that does not contain the format's end tag, closed by that tag (an
xgrammar structural tag whose content is `any_text` excluding the end): the answer's grammar
starts right after the first end tag, so nothing the model thinks is constrained and nothing it
answers escapes the constraint. With `opened_by_prompt` (the chat template wrote the start tag)
the output begins inside the thinking, which is therefore required; otherwise the thinking block
is optional and, when present, begins the output.

A composed grammar is compiled against the vocabulary for free text (vocab.py): the thinking may
hold newlines, which the JSON vocabulary without any_whitespace leaves out.
"""

from __future__ import annotations

import json
from typing import Any

import xgrammar as xgr

from radixserve.workers.protocol import REASONING_FORMATS, ReasoningFormat


def think_block(fmt: ReasoningFormat) -> xgr.Grammar:
    """The thinking: (start tag, unless the prompt opened it) any text without the end tag, then
    the end tag; optional unless the prompt opened it."""
    block: dict[str, Any] = {
        "type": "tag",
        "begin": "" if fmt.opened_by_prompt else fmt.start,
        "content": {"type": "any_text"},
        "end": fmt.end,
    }
    if not fmt.opened_by_prompt:
        block = {"type": "optional", "content": block}
    return xgr.Grammar.from_structural_tag(json.dumps({"type": "structural_tag", "format": block}))


def after_thinking(answer: xgr.Grammar, reasoning: str | None) -> xgr.Grammar:
    """`answer` preceded by the thinking of the named REASONING_FORMATS convention (None: as is)."""
    if reasoning is None:
        return answer
    return xgr.Grammar.concat(think_block(REASONING_FORMATS[reasoning]), answer)
