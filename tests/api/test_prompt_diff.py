"""The diverged detector (loomserve.api.prompt_diff) on a synthetic agent session: turns that
extend their predecessor pass; an edited message, a compaction and a template that renders the
same history differently are found at the right message, byte offset and excerpt."""

from __future__ import annotations

from loomserve.api.prompt_diff import SessionPrompts, find_divergence, first_difference, scan


def render(messages, stamp=""):
    """A stand-in chat template (optionally unstable: a per-turn stamp in the system part)."""
    out = []
    for m in messages:
        extra = stamp if m["role"] == "system" else ""
        out.append(f"<|{m['role']}|>{extra}{m['content']}<|end|>\n")
    return "".join(out) + "<|assistant|>"


SYSTEM = {"role": "system", "content": "You are a coding agent. Tools: read, edit, bash."}
T1 = [SYSTEM, {"role": "user", "content": "Fix the failing test in parser.py"}]
T2 = T1 + [{"role": "assistant", "content": "Reading parser.py"},
           {"role": "tool", "content": "def parse(x):\n    return x"}]
T3 = T2 + [{"role": "assistant", "content": "Editing"}, {"role": "tool", "content": "ok"}]


def turn(messages, session="s", stamp=""):
    return {"session": session, "messages": messages, "text": render(messages, stamp)}


def test_extending_turns_are_not_reported():
    assert scan([turn(T1), turn(T2), turn(T3)]) == []
    assert first_difference("abc", "abd") == 2 and first_difference("ab", "abc") == 2


def test_edited_history_found_at_message_and_byte():
    edited = [dict(m) for m in T3]
    edited[3] = {"role": "tool", "content": "def parse(x):\n    return int(x)"}  # rewritten
    found = scan([turn(T1), turn(T2), turn(edited)])
    assert [i for i, _ in found] == [2]
    d = found[0][1]
    assert d.kind == "edited" and d.message_index == 3
    text = render(edited)
    prefix = text.encode()[:d.byte_offset].decode()
    assert prefix.endswith("    return ") and "int(x)" in d.current and "int(x)" not in d.previous


def test_moved_system_reminder_and_compaction():
    moved = [T2[0], T2[2], T2[1], T2[3]]  # the user message moved after the reply
    d = scan([turn(T2), turn(moved)])[0][1]
    assert d.kind == "edited" and d.message_index == 1
    compacted = [SYSTEM, {"role": "user", "content": "Summary: parser fixed"}]
    d = scan([turn(T3), turn(compacted)])[0][1]
    assert d.kind == "edited" and d.message_index == 1
    d = find_divergence(T3, None, T3[:2], None)
    assert d.kind == "removed" and d.message_index == 2 and d.byte_offset == -1


def test_template_instability_same_messages_other_text():
    """The messages extend the previous turn's, but the template stamps the system part anew
    each turn: the text diverges inside message 0 while every message compares equal."""
    found = scan([turn(T1, stamp="[t=1]"), turn(T2, stamp="[t=2]")])
    d = found[0][1]
    assert d.kind == "template" and d.message_index == 0
    assert d.byte_offset == len("<|system|>[t=")
    assert "[t=1]You are" in d.previous and "[t=2]You are" in d.current


def test_sessions_are_separate_and_bounded():
    sp = SessionPrompts(max_sessions=2)
    assert sp.observe("a", T1, render(T1)) is None
    assert sp.observe("b", T3, render(T3)) is None
    assert sp.observe("c", T1, render(T1)) is None  # a is forgotten
    assert sp.observe("a", [SYSTEM], render([SYSTEM])) is None
    assert sp.observe("c", [SYSTEM], render([SYSTEM])).kind == "removed"
    assert sp.observe(None, T1, "x") is None
