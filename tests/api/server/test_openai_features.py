"""Chat Completions / Completions features with the official client on the tiny fixtures:
n samples, logprobs, penalties and logit_bias, several served names, the tool fallback of a
template without tools (--chat-template), and forced calls on the default model."""

import json
import math

import httpx
import openai
import pytest

from tests.api.server.conftest import TINY_AGENT, app_over
from tests.api.server.test_openai_tools import ASK, WEATHER, check_args

CHAT = [{"role": "user", "content": "Tell me about the fox."}]


def test_n_gives_n_choices(client, server):
    r = client.chat.completions.create(model=server.model, messages=CHAT, n=3, max_tokens=6,
                                       temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 18
    assert len({c.message.content for c in r.choices}) > 1  # seed + i per sample
    again = client.chat.completions.create(model=server.model, messages=CHAT, n=3, max_tokens=6,
                                           temperature=1.0, seed=5,
                                           extra_body={"ignore_eos": True})
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    chunks = list(client.chat.completions.create(
        model=server.model, messages=CHAT, n=3, max_tokens=6, temperature=1.0, seed=5,
        stream=True, extra_body={"ignore_eos": True}))
    texts, reasons = {}, {}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert reasons == {0: "length", 1: "length", 2: "length"}
    assert [texts[i] for i in range(3)] == [c.message.content for c in r.choices]
    comp = client.completions.create(model=server.model, prompt="The fox", n=2, max_tokens=4,
                                     seed=1, extra_body={"ignore_eos": True})
    assert [c.index for c in comp.choices] == [0, 1] and comp.usage.completion_tokens == 8
    server.wait_idle()


def _check_top(top: list, k: int) -> None:
    values = [t.logprob for t in top]
    assert len(top) == k and values == sorted(values, reverse=True)
    assert all(v <= 0 for v in values)


def test_chat_logprobs_shape_and_values(client, server):
    kw = dict(model=server.model, messages=CHAT, max_tokens=8, temperature=0, logprobs=True,
              top_logprobs=3, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 8
    for item in content:
        assert item.logprob <= 0
        if "\ufffd" not in item.token:  # part of a character: the bytes are exact, not U+FFFD
            assert bytes(item.bytes).decode("utf-8") == item.token
        _check_top(item.top_logprobs, 3)
        # greedy: the sampled token is the most likely one
        assert math.isclose(item.logprob, item.top_logprobs[0].logprob, abs_tol=1e-5)
    text = bytes(b for i in content for b in i.bytes).decode("utf-8", "replace")
    assert text.startswith(r.choices[0].message.content)  # an unfinished character is held
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed = [i for c in chunks for ch in c.choices if ch.logprobs for i in ch.logprobs.content]
    assert [(i.token, round(i.logprob, 4)) for i in streamed] == \
        [(i.token, round(i.logprob, 4)) for i in content]
    plain = client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=2,
                                           logprobs=True, extra_body={"ignore_eos": True})
    assert all(i.top_logprobs == [] for i in plain.choices[0].logprobs.content)


def test_completions_logprobs_shape(client, server):
    r = client.completions.create(model=server.model, prompt="The quick brown", max_tokens=6,
                                  temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for value, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and len(top) == 2 and math.isclose(value, max(top.values()),
                                                             abs_tol=1e-5)


def test_logit_bias_and_penalties_change_the_output(client, server):
    kw = dict(model=server.model, messages=CHAT, max_tokens=6, temperature=0,
              extra_body={"ignore_eos": True})
    tok = server.engine.tokenizer
    forced = client.chat.completions.create(logit_bias={"65": 100}, **kw)
    assert forced.choices[0].message.content == tok.decode([65] * 6)
    other = client.chat.completions.create(logit_bias={"65": -100, "66": 100}, **kw)
    assert other.choices[0].message.content == tok.decode([66] * 6)
    # bias 3 makes token 65 win every greedy step; each penalty, passed through, stops that
    def count_65(**extra) -> int:
        body = {"ignore_eos": True, **extra.pop("extra_body", {})}
        r = client.chat.completions.create(logit_bias={"65": 3}, **extra, **{**kw,
                                                                          "extra_body": body})
        return tok.encode(r.choices[0].message.content, add_special_tokens=False).count(65)

    assert count_65() == 6
    assert count_65(presence_penalty=2.0) < 6
    assert count_65(frequency_penalty=2.0) < 6
    assert count_65(extra_body={"repetition_penalty": 2.0}) < 6
    r = client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=4,
                                       extra_body={"min_tokens": 4, "repetition_penalty": 1.3})
    assert r.usage.completion_tokens == 4


CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_fallback_template_and_served_names(tmp_path, agent_server):
    """--chat-template without tools: schemas go into the system prompt, forced calls still
    come out as tool_calls; --served-model-name with two names."""
    from loomserve.api.chat.frontend import ChatFrontend, ChatRequest
    from loomserve.api.serve import chat_options
    from loomserve.engine.tokenizer import Tokenizer

    path = tmp_path / "chatml.jinja"
    path.write_text(CHATML)
    args = type("Args", (), {"chat_template": str(path), "served_model_names": ["main", "alias"],
                             "tool_call_parser": "auto", "reasoning_parser": "auto"})()
    options = chat_options(args)
    with app_over(agent_server.engine, app_options=options) as srv:  # the session engine
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
        assert [m.id for m in c.models.list().data] == ["main", "alias"]
        assert c.models.retrieve("alias").id == "alias"
        r = c.chat.completions.create(model="alias", messages=ASK, tools=[WEATHER],
                                      tool_choice="required", parallel_tool_calls=False,
                                      temperature=1.0, seed=1, max_tokens=200)
        assert r.model == "alias" and r.choices[0].finish_reason == "tool_calls"
        check_args(WEATHER["function"]["parameters"],
                   r.choices[0].message.tool_calls[0].function.arguments)
        fe = ChatFrontend(Tokenizer.from_folder(TINY_AGENT), chat_template=CHATML)
        prepared = fe.prepare(ChatRequest(ASK, [WEATHER]))
        assert prepared.prompt_text.startswith("<|im_start|>system\nUse tools.\n\n# Tools")
        assert json.dumps(WEATHER["function"]["parameters"]) in prepared.prompt_text
        assert r.usage.prompt_tokens == len(prepared.prompt_token_ids)
        with pytest.raises(openai.NotFoundError):
            c.chat.completions.create(model="other", messages=ASK, max_tokens=1)
        assert httpx.get(srv.url + "/v1/models/other").status_code == 404


def test_sessions_and_samples_reach_the_engine(client, server, monkeypatch):
    """prompt_cache_key is the session (user is not); samples i > 0 are siblings of sample 0."""
    seen = []
    generate = server.engine.generate

    def spy(prompt, params, request_id=None, **kw):
        seen.append((request_id, params.seed, kw))
        return generate(prompt, params, request_id, **kw)

    monkeypatch.setattr(server.engine, "generate", spy)
    r = client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=2, n=2,
                                       seed=9, user="end-user-1", prompt_cache_key="conv-7",
                                       extra_body={"ignore_eos": True})
    seen.sort()
    assert [s[0] for s in seen] == [f"{r.id}-0", f"{r.id}-1"]
    assert [s[1] for s in seen] == [9, 10]
    assert all(s[2]["session_id"] == "conv-7" for s in seen)
    assert "sibling_of" not in seen[0][2] and seen[1][2]["sibling_of"] == f"{r.id}-0"


def test_serve_flags():
    from loomserve.cli import build_parser, engine_config_from_args, main

    args = build_parser().parse_args(["serve", "m", "--served-model-name", "a", "b",
                                      "--tool-call-parser", "hermes", "--reasoning-parser",
                                      "none", "--chat-template", "/x.jinja"])
    assert engine_config_from_args(args).model.served_model_name == "a"
    assert args.served_model_names == ["a", "b"] and args.chat_template == "/x.jinja"
    # unknown parser names and unreadable templates fail before the model loads
    assert main(["serve", "m", "--tool-call-parser", "nope"]) == 2
    assert main(["serve", "m", "--chat-template", "/no/such/file.jinja"]) == 2
