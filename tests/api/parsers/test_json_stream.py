"""JsonScanner: any JSON object, split anywhere, reads back as itself; at every point its safe
prefix plus closing() is valid JSON; invalid text fails at the first bad character."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loomserve.api.tool_parsers.json_stream import JsonScanner
from tests.api.parsers.helpers import chunks

scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False,
                                                                  allow_infinity=False) | st.text()
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=5), inner, max_size=4), max_leaves=12)
objects = st.dictionaries(st.text(max_size=6), values, max_size=5)


@settings(max_examples=100, deadline=None)
@given(obj=objects, indent=st.sampled_from([None, 2]), ascii_=st.booleans(),
       cuts=st.lists(st.integers(0, 400), max_size=10), tail=st.sampled_from(["", " x", "}"]))
def test_any_object_any_split(obj, indent, ascii_, cuts, tail):
    text = json.dumps(obj, indent=indent, ensure_ascii=ascii_)
    scanner, consumed, safe_seen = JsonScanner(), 0, ""
    for piece in chunks(text + tail, cuts):
        if scanner.done:
            break
        consumed += scanner.feed(piece)
        safe = scanner.out[: scanner.safe_len]
        assert safe.startswith(safe_seen)  # the safe prefix only grows
        safe_seen = safe
        json.loads(safe + scanner.closing() if safe else "{}")
    assert scanner.done and not scanner.failed
    assert consumed == len(text)
    assert scanner.out == text
    assert json.loads(scanner.out) == obj
    assert set(scanner.members) == set(obj)


@pytest.mark.parametrize("text,bad_at", [
    ('{"a": tru}', 9), ('{"a" 1}', 5), ('{"a": [1,]}', 9), ('[1]', 0), ('{"a": "\\x"}', 8),
    ('{"a": 01}', 8), ('{,}', 1), ('{"a": 1}}', None),
])
def test_invalid_text_fails_at_the_first_bad_character(text, bad_at):
    for pieces in ([text], list(text)):
        scanner, consumed = JsonScanner(), 0
        for piece in pieces:
            consumed += scanner.feed(piece)
            if scanner.failed or scanner.done:
                break
        if bad_at is None:
            assert scanner.done and consumed == len(text) - 1
        else:
            assert scanner.failed and consumed == bad_at
            if scanner.started:
                json.loads(scanner.out[: scanner.safe_len] + scanner.closing())


def test_raw_control_characters_in_strings_are_escaped():
    scanner = JsonScanner()
    scanner.feed('{"code": "a\n\tb"}')
    assert scanner.done and json.loads(scanner.out) == {"code": "a\n\tb"}
