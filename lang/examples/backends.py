"""The examples' command line: `--url` runs them on a server, else on an offline Engine."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import radixserve.lang as rl


def run_example(main: Callable[[rl.Backend], Any], description: str | None) -> None:
    """Parse the command line, run `main` on its backend and print the result; an offline
    engine started here is shut down after."""
    backend = backend_from_args(description or "")
    try:
        print(main(backend))
    finally:
        if isinstance(backend, rl.EngineBackend):
            backend.shutdown()


def backend_from_args(description: str) -> rl.Backend:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--url", help="a running server (default: an offline Engine of the default model)")
    p.add_argument("--api-key")
    p.add_argument(
        "--tokenizer",
        help="with --url: render roles with this Hugging Face dir's chat template, not the server's",
    )
    args = p.parse_args()
    if args.url is None:
        return rl.EngineBackend.start()
    template = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        template = AutoTokenizer.from_pretrained(args.tokenizer)
    return rl.RuntimeEndpoint(args.url, api_key=args.api_key, chat_template=template)
