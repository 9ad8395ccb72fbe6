"""The router's prompt keys (token ids and block hashes from an API body, incremental per
session), common_prefix_len, and the error events a relayed stream ends with."""

from __future__ import annotations

import os

import pytest

from loomserve.control.router.tokens import PromptKeys, common_prefix_len
from loomserve.kv.hashing import hash_chain

TINY_LLAMA = os.path.join(os.path.dirname(__file__), "..", "fixtures", "tiny-llama")


@pytest.fixture(scope="module")
def keys():
    if not os.path.isdir(TINY_LLAMA):
        pytest.skip("tests/fixtures/tiny-llama is missing")
    return PromptKeys.from_folder(TINY_LLAMA, 4)


def _full(keys: PromptKeys, messages, salt=None):
    fresh = PromptKeys(keys.tok, 4)
    ids = fresh.prompt_ids("chat", {"messages": messages}, None)
    return ids, hash_chain(ids, 4, salt)


def test_prompt_keys_incremental_turns_equal_a_full_encode(keys):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name three looms, with  odd   spacing."}]
    for turn in range(4):
        body = {"messages": messages, "cache_salt": "t"}
        ids, hashes = keys.keys("chat", body, "s")
        assert (ids, hashes) == _full(keys, messages, "t")
        messages = messages + [{"role": "assistant", "content": f"answer {turn} ok"},
                               {"role": "user", "content": f"and then{turn}? é"}]
    edited = [dict(messages[0], content="You are verbose.")] + messages[1:]
    assert keys.keys("chat", {"messages": edited}, "s") == _full(keys, edited)


def test_prompt_keys_apis(keys):
    ids, _ = keys.keys("completions", {"prompt": "hello loom"}, None)
    assert ids == keys.tok.encode("hello loom", add_special_tokens=True)
    assert keys.keys("completions", {"prompt": [5, 6, 7]}, None)[0] == [5, 6, 7]
    chat = keys.prompt_ids("chat", {"messages": [{"role": "user", "content": "hi"}]}, None)
    msgs = keys.prompt_ids("messages", {"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": "hi"}]}, None)
    resp = keys.prompt_ids("responses", {"input": "hi"}, None)
    assert chat == msgs == resp and chat
    assert keys.keys("responses", {"input": "hi", "previous_response_id": "resp_1"}, None) \
        is None  # the history lives on the instance
    assert keys.keys("chat", {"messages": "not a list"}, None) is None


def test_common_prefix_len():
    assert common_prefix_len("abcdef", "abcxef") == 3
    assert common_prefix_len([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix_len("", "x") == 0


def test_prompt_keys_subagent_starts_from_its_parents_memo(keys):
    base = [{"role": "system", "content": "Shared context " * 20},
            {"role": "user", "content": "Parent task"}]
    keys.keys("chat", {"messages": base}, "parent-1")
    child = base[:1] + [{"role": "user", "content": "Subtask: grep the loom module"}]
    assert keys.keys("chat", {"messages": child}, "child-1", "parent-1") == _full(keys, child)
    assert keys.keys("chat", {"messages": child}, None, "parent-1") == _full(keys, child)


def test_stream_error_events_in_each_api_shape():
    import json as _json

    from loomserve.control.router.proxy import sse_error

    def data_of(raw: bytes) -> dict:
        line = next(x for x in raw.decode().splitlines() if x.startswith("data: "))
        return _json.loads(line[6:])
    chat = data_of(sse_error("chat", "boom"))
    assert chat["error"]["message"] == "boom" and chat["error"]["code"] == "instance_failed"
    raw = sse_error("messages", "boom")
    assert b"event: error\n" in raw
    assert data_of(raw) == {"type": "error", "error": {"type": "api_error", "message": "boom"}}
    resp = data_of(sse_error("responses", "boom"))
    assert resp["type"] == "error" and resp["message"] == "boom"
    assert sse_error("chat", "x").startswith(b"\n\n")  # ends a half-relayed event first


def test_common_prefix_len_with_a_hint():
    a, b = list(range(100)), list(range(60)) + [0] * 40
    assert common_prefix_len(a, b, 50) == 60
    assert common_prefix_len(a, b, 80) == 60  # a wrong hint is checked, not trusted
    assert common_prefix_len("abc", "abd", 5) == 2


def test_prompt_keys_with_the_instances_chat_template(keys):
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    custom = PromptKeys(keys.tok, 4, chat_template=template)
    ids = custom.prompt_ids("chat", {"messages": [{"role": "user", "content": "hi"}]}, None)
    assert ids == keys.tok.encode("[user] hi\n", add_special_tokens=False)

