"""Model code: checkpoint loading (HF directories, GGUF, the embedded default), model configs, the
decoder architectures, their layers and the attention backends over the paged KV pool, and the
ForwardBatch a forward reads."""
