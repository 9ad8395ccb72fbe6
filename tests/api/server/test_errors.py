"""Bad input gets an OpenAI-style 4xx JSON error, and the server keeps serving."""

import httpx
import openai
import pytest

MSG = [{"role": "user", "content": "hi"}]


def _cases(server):
    eng = server.engine
    n = eng.max_model_len
    too_long = [1] * n
    chat = "/v1/chat/completions"
    comp = "/v1/completions"
    return [
        # (route, raw body or dict, status, param or None)
        ("malformed json", chat, "{not json", 400, None),
        ("body not an object", chat, "[1, 2]", 400, None),
        ("missing messages", chat, {"model": server.model}, 400, "messages"),
        ("messages wrong type", chat, {"messages": "hello"}, 400, "messages"),
        ("message missing role", chat, {"messages": [{"content": "x"}]}, 400, "messages"),
        ("empty messages", chat, {"messages": []}, 400, "messages"),
        ("image content part", chat, {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages"),
        ("unknown model", chat, {"model": "no-such-model", "messages": MSG}, 404, "model"),
        ("n=0", chat, {"messages": MSG, "n": 0}, 400, "n"),
        ("legacy functions", chat, {"messages": MSG, "functions": [{"name": "f"}]}, 400,
         "functions"),
        ("temperature > 2", chat, {"messages": MSG, "temperature": 2.5}, 400, "temperature"),
        ("temperature < 0", chat, {"messages": MSG, "temperature": -0.1}, 400, "temperature"),
        ("top_p = 0", chat, {"messages": MSG, "top_p": 0}, 400, "top_p"),
        ("top_p > 1", chat, {"messages": MSG, "top_p": 1.5}, 400, "top_p"),
        ("temperature wrong type", chat, {"messages": MSG, "temperature": "hot"}, 400,
         "temperature"),
        ("max_tokens 0", chat, {"messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
        ("max_completion_tokens 0", chat, {"messages": MSG, "max_completion_tokens": 0}, 400,
         "max_completion_tokens"),
        ("max_tokens beyond context", chat, {"messages": MSG, "max_tokens": n}, 400, None),
        ("stream max_tokens beyond context", chat,
         {"messages": MSG, "max_tokens": n, "stream": True}, 400, None),
        ("prompt too long", comp, {"prompt": too_long, "max_tokens": 1}, 400, None),
        ("prompt too long, streaming", comp,
         {"prompt": too_long, "max_tokens": 1, "stream": True}, 400, None),
        ("unknown token id", comp, {"prompt": [1, eng.vocab_size]}, 400, None),
        ("negative token id", comp, {"prompt": [1, -1]}, 400, None),
        ("empty prompt ids", comp, {"prompt": []}, 400, "prompt"),
        ("empty prompt text", comp, {"prompt": ""}, 400, None),
        ("batch of prompts", comp, {"prompt": ["a", "b"]}, 400, "prompt"),
        ("prompt wrong type", comp, {"prompt": 12}, 400, "prompt"),
        ("missing prompt", comp, {"max_tokens": 3}, 400, "prompt"),
        ("echo", comp, {"prompt": "a", "echo": True}, 400, "echo"),
        ("completions unknown model", comp, {"model": "nope", "prompt": "a"}, 404, "model"),
        ("completions max_tokens beyond context", comp, {"prompt": "a", "max_tokens": n}, 400,
         None),
    ]


def test_bad_inputs_get_openai_errors_and_the_server_keeps_serving(server, client):
    failures = []
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for name, route, body, status, param in _cases(server):
            if isinstance(body, str):
                r = http.post(route, content=body, headers={"content-type": "application/json"})
            else:
                r = http.post(route, json=body)
            try:
                err = r.json()["error"]
                ok = (r.status_code == status and set(err) == {"message", "type", "param", "code"}
                      and err["message"] and err["type"]
                      and (param is None or err["param"] == param))
            except Exception:  # noqa: BLE001 - report below with the body
                ok = False
            if not ok:
                failures.append(f"{name}: {r.status_code} {r.text[:300]}")
        assert not failures, "\n".join(failures)
        r = http.post("/v1/chat/completions", json={"model": "nope", "messages": MSG})
        assert r.json()["error"]["code"] == "model_not_found"
        r = http.get("/v1/no/such/route")
        assert r.status_code == 404 and r.json()["error"]["message"]
    server.wait_idle()
    ok = client.completions.create(model=server.model, prompt="still alive?", max_tokens=2)
    assert ok.usage.completion_tokens >= 1


def test_openai_client_raises_typed_errors(client, server):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=MSG)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.model, messages=MSG, temperature=3)
    assert e.value.param == "temperature"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=server.model, messages=MSG,
                                       max_tokens=server.engine.max_model_len, stream=True)
