"""Everything that runs a model. `from radixserve.workers import Engine` is the offline API.

The import is lazy so that the router, which only needs `radixserve.workers.protocol`, does not
pull in torch and the model code.
"""

from typing import Any

import radixserve.kernels  # noqa: F401  (OpenMP's wait policy, before torch loads)

__all__ = ["Engine"]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from radixserve.workers.engine.engine import Engine

        return Engine
    raise AttributeError(name)
