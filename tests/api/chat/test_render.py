"""Rendering a tool conversation through chat templates: byte-stable history turn to turn
(each turn's prompt is a prefix of the next one's), the tools= path and the Hermes fallback."""

import json
import os

import pytest

from loomserve.api.chat.frontend import ChatFrontend, ChatInputError, ChatRequest
from loomserve.api.chat.render import ChatRenderer
from loomserve.engine.tokenizer import Tokenizer

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}, "strict": True}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {}}}}


def _call(cid, name, args):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


# A conversation that grows by one exchange per turn: (messages added by the turn's request,
# the assistant reply the next request carries back).
TURNS = [
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Paris weather?"}],
     {"role": "assistant", "content": None, "reasoning_content": "Use the tool.",
      "tool_calls": [_call("c1", "get_weather", '{"city":  "Paris"}')]}),
    ([{"role": "tool", "tool_call_id": "c1", "content": "sunny, 21C"}],
     {"role": "assistant", "content": "Checking the time too.",
      "tool_calls": [_call("c2", "get_time", "{}"), _call("c3", "get_weather",
                                                          '{"city": "Lyon"}')]}),
    ([{"role": "tool", "tool_call_id": "c2", "content": "10:00"},
      {"role": "tool", "tool_call_id": "c3", "content": [{"type": "text", "text": "rain"}]}],
     {"role": "assistant", "content": "Sunny in Paris, rain in Lyon, 10:00."}),
    ([{"role": "user", "content": "Thanks!"}], None),
]


def _frontend(name: str, template: str | None = None) -> ChatFrontend:
    folder = os.path.join(FIXTURES, name)
    if not os.path.isdir(folder):
        pytest.skip(f"tests/fixtures/{name} is missing")
    return ChatFrontend(Tokenizer.from_folder(folder), chat_template=template)


def _prompts(fe: ChatFrontend) -> list[str]:
    messages, prompts = [], []
    for added, reply in TURNS:
        messages += added
        prompts.append(fe.prepare(ChatRequest(list(messages), [WEATHER, CLOCK])).prompt_text)
        if reply is not None:
            messages.append(reply)
    return prompts


@pytest.mark.parametrize("fixture", ["tiny-agent", "tiny-llama"])
def test_each_turn_is_a_prefix_of_the_next(fixture):
    fe = _frontend(fixture)
    first, again = _prompts(fe), _prompts(fe)
    assert first == again  # same messages -> same bytes
    for a, b in zip(first, first[1:]):
        assert b.startswith(a) and len(b) > len(a)
    ids = [fe.tokenizer.encode(p, add_special_tokens=False) for p in first]
    for a, b in zip(ids, ids[1:]):  # and the token ids too, which the prefix cache keys on
        assert b[:len(a)] == a


def test_template_with_tools_gets_them_and_the_history_as_is():
    fe = _frontend("tiny-agent")
    assert fe.renderer.supports_tools and fe.renderer.arguments_as_string
    assert fe.tool_parser_name == "hermes" and fe.reasoning_parser_name == "qwen3"
    text = _prompts(fe)[-1]
    assert json.dumps(WEATHER["function"]["parameters"]) in text
    assert '"strict"' not in text  # a sampling option, not shown to the model
    # the client's argument text as given (the template tests `arguments is string`)
    assert '{"name": "get_weather", "arguments": {"city":  "Paris"}}' in text
    assert "<think>\nUse the tool.\n</think>" in text
    assert "<tool_response>\n10:00\n</tool_response>\n<tool_response>\nrain\n" in text


def test_fallback_puts_tools_in_the_system_message_and_calls_in_the_content():
    fe = _frontend("tiny-llama")
    assert not fe.renderer.supports_tools and fe.tool_parser_name == "hermes"
    text = _prompts(fe)[-1]
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert '"name": "get_weather"' in system and "<tool_call>" in system
    assert ('<|im_start|>assistant\nChecking the time too.\n<tool_call>\n'
            '{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_call>') in text
    # both results of one exchange in one user turn
    assert ("<|im_start|>user\n<tool_response>\n10:00\n</tool_response>\n<tool_response>\n"
            "rain\n</tool_response><|im_end|>") in text
    assert "tool" not in [m.split("\n")[0] for m in text.split("<|im_start|>")]


def test_fallback_writes_the_clients_argument_text_as_given():
    """A model's call comes back as the client's text (here pretty-printed, as SmolLM2 writes
    it): the fallback renders those bytes, so the next turn hits the cache past the call."""
    fe = _frontend("tiny-llama")
    args = '{\n    "city": "Paris"\n}'
    text = fe.prepare(ChatRequest([
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [_call("c1", "get_weather", args)]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}], [WEATHER])).prompt_text
    assert f'<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>' in text


def test_fallback_without_a_system_message_adds_one():
    fe = _frontend("tiny-llama")
    p = fe.prepare(ChatRequest([{"role": "user", "content": "hi"}], [CLOCK]))
    assert p.prompt_text.startswith("<|im_start|>system\n# Tools")
    plain = fe.prepare(ChatRequest([{"role": "user", "content": "hi"}]))
    assert plain.prompt_text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_arguments_as_objects_where_the_template_does_not_test_strings():
    template = ("{% for m in messages %}{% for c in m.tool_calls or [] %}"
                "{{ c.function.arguments | tojson }}|{{ c.function.arguments | tojson("
                "separators=(',', ':'), sort_keys=true) }}{% endfor %}{% endfor %}{{ tools }}")
    r = ChatRenderer(template)
    assert r.supports_tools and not r.arguments_as_string
    msgs = [{"role": "assistant", "content": "", "tool_calls": [
        _call("c", "f", '{"b": 1,   "a": "é"}')]}]
    assert r.render(msgs, None).startswith('{"b": 1, "a": "é"}|{"a":"é","b":1}')


@pytest.mark.parametrize("messages,tools,choice,param", [
    ([{"role": "robot", "content": "x"}], None, "auto", "messages"),
    ([{"role": "tool", "tool_call_id": "nope", "content": "x"}], None, "auto", "messages"),
    ([{"role": "assistant", "content": "", "tool_calls": [_call("c", "f", "[1]")]}], None,
     "auto", "messages"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], None, "auto", "messages"),
    ([{"role": "user", "content": "x"}], [{"type": "function", "function": {
        "parameters": {"type": "object"}}}], "auto", "tools"),
    ([{"role": "user", "content": "x"}], [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "array"}}}], "auto", "tools"),
    ([{"role": "user", "content": "x"}], [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "strin"}}}}}],
     "auto", "tools"),
    ([{"role": "user", "content": "x"}], [WEATHER, WEATHER], "auto", "tools"),
    ([{"role": "user", "content": "x"}], [WEATHER], {"type": "function",
                                                     "function": {"name": "other"}}, "tool_choice"),
    ([{"role": "user", "content": "x"}], None, "required", "tool_choice"),
])
def test_bad_input_is_a_chat_input_error_naming_the_field(messages, tools, choice, param):
    fe = _frontend("tiny-agent")
    with pytest.raises(ChatInputError) as e:
        fe.prepare(ChatRequest(messages, tools, choice))
    assert e.value.param == param and e.value.message


def test_grammar_for_tool_choice_and_response_format():
    fe = _frontend("tiny-agent")
    user = [{"role": "user", "content": "x"}]
    required = fe.prepare(ChatRequest(user, [WEATHER, CLOCK], "required",
                                      parallel_tool_calls=False)).structured.tool_calls
    assert required.required and not required.parallel and len(required.calls) == 2
    assert required.calls[0].begin == '<tool_call>\n{"name": "get_weather", "arguments": '
    named = fe.prepare(ChatRequest(user, [WEATHER, CLOCK], {
        "type": "function", "function": {"name": "get_time"}})).structured.tool_calls
    assert [c.begin for c in named.calls] == ['<tool_call>\n{"name": "get_time", "arguments": ']
    strict = fe.prepare(ChatRequest(user, [WEATHER, CLOCK], "auto")).structured.tool_calls
    assert not strict.required and strict.triggers == ["<tool_call>"]
    assert json.loads(strict.calls[1].schema) == {"type": "object"}  # get_time is not strict
    none = fe.prepare(ChatRequest(user, [WEATHER], "none"))
    assert none.structured is None and none.tool_parser_cls is None
    assert "get_weather" in none.prompt_text  # still rendered: the prompt stays stable
    js = fe.prepare(ChatRequest(user, response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}}})).structured
    assert json.loads(js.json_schema) == {"type": "object"}
    assert fe.prepare(ChatRequest(user, response_format={"type": "json_object"})
                      ).structured.json_object
    for choice in ("none", "auto"):  # the answer is JSON; forced calls would win instead
        assert fe.prepare(ChatRequest(user, [WEATHER], choice, response_format={
            "type": "json_object"})).structured.json_object
    with pytest.raises(ChatInputError) as e:
        fe.prepare(ChatRequest(user, response_format={"type": "json_schema", "json_schema": {
            "schema": {"type": "nonsense"}}}))
    assert e.value.param == "response_format"


def test_count_tokens_matches_prepare():
    fe = _frontend("tiny-agent")
    req = ChatRequest([{"role": "user", "content": "hello there"}], [WEATHER])
    assert fe.count_tokens(req) == len(fe.prepare(req).prompt_token_ids)


def test_template_kwargs_and_reasoning_pass_back():
    template = ("{% for m in messages %}[{{ m.role }}:{{ m.reasoning_content }}|{{ m.content }}]"
                "{% endfor %}{{ enable_thinking }}/{{ reasoning_effort }}")
    fe = _frontend("tiny-agent", template)
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "a", "reasoning": "thought"}]
    p = fe.prepare(ChatRequest(msgs, template_kwargs={"enable_thinking": False,
                                                       "reasoning_effort": "low"}))
    assert p.prompt_text == "[user:|q][assistant:thought|a]False/low"
    with pytest.raises(ChatInputError):
        fe.prepare(ChatRequest(msgs, template_kwargs={"messages": []}))


def test_developer_role_is_system_for_templates_that_predate_it():
    fe = _frontend("tiny-llama")
    p = fe.prepare(ChatRequest([{"role": "developer", "content": "Rules."},
                                {"role": "user", "content": "hi"}]))
    assert p.prompt_text.startswith("<|im_start|>system\nRules.<|im_end|>")
    knows = _frontend("tiny-llama",
                      "{% for m in messages %}{{ m.role }}/{% endfor %}{# developer #}")
    assert knows.prepare(ChatRequest([{"role": "developer", "content": "x"}])).prompt_text == \
        "developer/"


def test_tool_parser_none_parses_no_calls_but_can_still_force_them():
    folder = os.path.join(FIXTURES, "tiny-agent")
    fe = ChatFrontend(Tokenizer.from_folder(folder), tool_parser="none", reasoning_parser="none")
    user = [{"role": "user", "content": "x"}]
    auto = fe.prepare(ChatRequest(user, [WEATHER]))
    assert auto.tool_parser_cls is None and auto.output_parser().reasoning_parser is None
    forced = fe.prepare(ChatRequest(user, [WEATHER], "required"))
    assert forced.tool_parser_cls.name == "hermes"  # the format forced is the one parsed
    with pytest.raises(ValueError):
        ChatFrontend(Tokenizer.from_folder(folder), tool_parser="nope")
