"""Benchmarks, run as modules from the repository root: `python -m load_tests.bench_offline`."""
