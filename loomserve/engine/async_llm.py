"""Asyncio front of the engine: the server's only way in. (Stub: the engine session fills it in.)

Contract
--------
AsyncLLM(config: EngineConfig)
    Loads the model and allocates the KV cache in the constructor. The engine loop runs in a
    background thread, so the event loop never blocks on a forward pass.
Attributes: tokenizer (loomserve.model.tokenizer.Tokenizer), model_name (served name),
    max_model_len (int), vocab_size (int), config (EngineConfig), kv_capacity_tokens (int).
async generate(prompt: str | list[int], params: SamplingParams, request_id: str | None = None, *,
               session_id=None, parent_session_id=None, cache_salt=None) -> AsyncIterator[RequestOutput]
    Validates before yielding anything and raises ValueError with a user-facing message for: an
    empty prompt, token ids outside [0, vocab_size), prompt longer than max_model_len - 1,
    prompt + max_tokens beyond max_model_len. max_tokens None = up to the context limit.
    Yields a RequestOutput per engine step with new tokens; the last one has finished=True.
    If the consumer stops iterating (aclose / task cancelled / client gone) the request is
    aborted and its blocks freed.
async abort(request_id) ; stats() -> EngineStats ; shutdown()
"""
