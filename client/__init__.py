"""The app's engine when it runs on a server: any OpenAI-compatible HTTP API (kvchat serve,
llama-server, vLLM, SGLang, Ollama's /v1), spoken with the standard library."""
