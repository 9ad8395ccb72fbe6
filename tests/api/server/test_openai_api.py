"""The OpenAI client, sync and async, against the real engine: shapes, streaming, sampling."""

import asyncio

CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Write a short poem about paged attention."}]


def chat(client, server, **kw):
    kw.setdefault("messages", CHAT)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=server.model, **kw)


def cached_on_repeat(server, prompt_tokens: int) -> int:
    """cached_tokens of a prompt sent again: its full blocks, except that the block holding the
    last prompt token is always computed (the cache serves at most prompt_tokens - 1)."""
    bs = server.engine.config.cache.block_size
    return (prompt_tokens - 1) // bs * bs


def test_chat_non_streaming_shape(client, server):
    r = chat(client, server, max_tokens=8, extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.model == server.model
    choice = r.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    u = r.usage
    assert u.completion_tokens == 8 and u.prompt_tokens > 0
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    # The session's server may hold this prompt from an earlier test: whole blocks, or none.
    full = cached_on_repeat(server, u.prompt_tokens)
    assert u.prompt_tokens_details.cached_tokens in range(0, full + 1,
                                                          server.engine.config.cache.block_size)
    again = chat(client, server, max_tokens=1, extra_body={"ignore_eos": True}).usage
    assert again.prompt_tokens == u.prompt_tokens
    assert again.prompt_tokens_details.cached_tokens == full


def test_chat_stream_matches_non_streaming_greedy(client, server):
    kw = dict(max_tokens=24, extra_body={"ignore_eos": True})
    full = chat(client, server, **kw)
    chunks = list(chat(client, server, stream=True, **kw))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert all(c.usage is None for c in chunks)


def test_chat_stream_include_usage(client, server):
    chat(client, server, max_tokens=1)  # the prompt's blocks are in the prefix cache
    chunks = list(chat(client, server, stream=True, max_tokens=5,
                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 5
    assert last.usage.total_tokens == last.usage.prompt_tokens + 5
    assert last.usage.prompt_tokens_details.cached_tokens == \
        cached_on_repeat(server, last.usage.prompt_tokens)
    assert chunks[-2].choices[0].finish_reason == "length"


def test_chat_content_parts_and_max_completion_tokens(client, server):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Write a short poem"},
                                          {"type": "text", "text": "about paged attention."}]}]
    r = chat(client, server, messages=parts, max_tokens=50, max_completion_tokens=3,
             extra_body={"ignore_eos": True}, user="someone", n=1)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_completions_text_and_token_prompts(client, server):
    tok = server.engine.tokenizer
    text_prompt = "The quick brown fox jumps over"
    ids = tok.encode(text_prompt)
    kw = dict(model=server.model, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    a = client.completions.create(prompt=text_prompt, **kw)
    b = client.completions.create(prompt=ids, **kw)
    c = client.completions.create(prompt=[ids], **kw)
    d = client.completions.create(prompt=[text_prompt], **kw)
    assert a.object == "text_completion" and a.id.startswith("cmpl-")
    assert a.usage.prompt_tokens == len(ids) == b.usage.prompt_tokens
    assert a.choices[0].text == b.choices[0].text == c.choices[0].text == d.choices[0].text
    assert a.choices[0].finish_reason == "length" and a.usage.completion_tokens == 6


def test_completions_stream(client, server):
    kw = dict(model=server.model, prompt="Once upon a time", max_tokens=12, temperature=0,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True},
                                            **kw))
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_repeated_long_prompt_hits_the_prefix_cache(client, server):
    block = server.engine.config.cache.block_size
    prompt = list(range(5, 5 + 6 * block + 3))
    kw = dict(model=server.model, prompt=prompt, max_tokens=2, temperature=0,
              extra_body={"ignore_eos": True})
    client.completions.create(**kw)
    again = client.completions.create(**kw)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert again.usage.prompt_tokens == len(prompt)
    assert cached == 6 * block  # the full blocks; the last 3 tokens are computed again
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True},
                                            **kw))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached


def test_max_tokens_gives_finish_reason_length(client, server):
    r = client.completions.create(model=server.model, prompt="Hello", max_tokens=1,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 1 and r.choices[0].finish_reason == "length"


def test_stop_string_cuts_the_text(client, server):
    kw = dict(model=server.model, prompt="Tell me a story about a dragon", temperature=0,
              extra_body={"ignore_eos": True})
    full = client.completions.create(max_tokens=32, **kw).choices[0].text
    stop = next((full[i:i + 2] for i in range(4, len(full) - 2) if full[i:i + 2].strip()), None)
    assert stop is not None, f"greedy text too short or blank to pick a stop string: {full!r}"
    expected = full[:full.index(stop)]
    r = client.completions.create(max_tokens=32, stop=[stop, "never-appears-xyz"], **kw)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == expected
    streamed = list(client.completions.create(max_tokens=32, stop=stop, stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_seed_makes_sampling_reproducible(client, server):
    kw = dict(messages=CHAT, temperature=1.0, top_p=0.9, max_tokens=16, seed=1234,
              extra_body={"ignore_eos": True, "top_k": 50})
    a = chat(client, server, **kw).choices[0].message.content
    b = chat(client, server, **kw).choices[0].message.content
    assert a == b


def test_session_headers_and_cache_salt_reach_the_engine(client, server, monkeypatch):
    seen = []
    generate = server.engine.generate

    def spy(prompt, params, request_id=None, **kw):
        seen.append((request_id, kw))
        return generate(prompt, params, request_id, **kw)

    monkeypatch.setattr(server.engine, "generate", spy)
    r = chat(client, server, max_tokens=2, extra_headers={"X-Session-ID": "s-1",
                                                          "X-Parent-Session-ID": "s-0"},
             extra_body={"cache_salt": "tenant-a", "ignore_eos": True})
    assert r.usage.completion_tokens == 2
    client.completions.create(model=server.model, prompt="no session", max_tokens=1)
    (rid, kw), (rid2, kw2) = seen
    assert rid == r.id and rid.startswith("chatcmpl-") and rid2.startswith("cmpl-")
    assert kw == {"session_id": "s-1", "parent_session_id": "s-0", "cache_salt": "tenant-a"}
    assert kw2 == {"session_id": None, "parent_session_id": None, "cache_salt": None}


def test_async_client_concurrent_requests(aclient_factory, server):
    async def main():
        aclient = aclient_factory()
        async def one(i):
            return await aclient.chat.completions.create(
                model=server.model, messages=[{"role": "user", "content": f"Count to {i}."}],
                max_tokens=8, temperature=0, extra_body={"ignore_eos": True})

        async def streamed():
            stream = await aclient.chat.completions.create(
                model=server.model, messages=CHAT, max_tokens=8, temperature=0, stream=True,
                extra_body={"ignore_eos": True})
            return [c async for c in stream]

        results = await asyncio.gather(*(one(i) for i in range(4)), streamed())
        await aclient.close()
        return results

    *plain, chunks = asyncio.run(main())
    assert all(r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"
               for r in plain)
    assert chunks[-1].choices[0].finish_reason == "length"
    server.wait_idle()


def test_models_and_health(client, server):
    import httpx
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model]
    assert client.models.retrieve(server.model).id == server.model
    h = httpx.get(server.url + "/health")
    assert h.status_code == 200
