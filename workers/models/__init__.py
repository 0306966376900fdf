"""Model code: checkpoint loading and the decoder architectures, run over the paged KV pool."""

from radixserve.workers.models.config import ModelConfig
from radixserve.workers.models.loader import LoadedModel, default_dtype, load_model

__all__ = ["LoadedModel", "ModelConfig", "default_dtype", "load_model"]
