"""kvchat: question very long texts with a local LLM through a block-sparse KV cache."""

__version__ = "0.1.0"
