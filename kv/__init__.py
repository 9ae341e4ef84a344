"""The KV cache and the attention backends that read it."""
