"""`kvchat serve`: the engine behind an OpenAI-compatible HTTP API."""
