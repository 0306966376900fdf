"""Structured output on xgrammar: grammar parsing and checks, compilation off the engine thread,
per-sequence matchers, bitmasks and jump-forward."""
