"""The server: the CLI, the Ray Serve application and its deployments."""

import radixserve.kernels  # noqa: F401  (OpenMP's wait policy, before torch loads)
