"""The engine: its loop and thread (engine.py), its state and one step (engine_core.py), the
scheduler and its admission order, requests, and output processing (detokenization, chunks)."""
