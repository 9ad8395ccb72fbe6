"""The HTTP server, in the front end's process: OpenAI Chat Completions and Completions,
Anthropic Messages and OpenAI Responses over AsyncLLM.

app.py and serve.py (the app; `loomserve serve`), handler.py (a request's life), one module set
per API (*_api.py, *_protocol.py, openai_output.py, responses store), errors.py, auth.py,
metrics.py; chat/ (the API-neutral chat layer), tool_parsers/ and reasoning/ (output parsers).
Below it, it uses the engine's client half (AsyncLLM, RequestOutput, the tokenizer) and the
tiers' metrics.
"""
