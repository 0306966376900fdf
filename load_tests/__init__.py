"""Benchmarks, run as modules from the repository root: `python -m load_tests.bench_offline`."""

# Before any benchmark imports torch: OpenMP's spin-wait setting, as the server has it.
import radixserve.kernels  # noqa: F401
