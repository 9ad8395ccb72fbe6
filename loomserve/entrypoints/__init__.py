"""Entry points: the CLI, the offline `LLM`, the asyncio front end `AsyncLLM` (tokenization,
detokenization, stop strings, the core client) and the HTTP server (server/)."""
