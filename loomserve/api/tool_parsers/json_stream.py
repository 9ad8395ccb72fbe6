"""An incremental, validating JSON scanner for streamed tool-call arguments.

`JsonScanner` reads one JSON value character by character, across any split of its text into
chunks, and keeps:
- `out`: the text read so far, as is except that raw control characters inside strings are
  written as escapes (models emit raw newlines in strings; strict JSON forbids them);
- a *safe point*: the longest prefix of `out` that a known suffix (`closing()`) turns into valid
  JSON without inventing anything but closing quotes and brackets. A trailing comma, a key, a
  colon, an escape or a number cut short are held behind the safe point;
- `members`: for an object at the top, each complete member's value span in `out`, and the
  span of the member being read (`current`), so a caller can stream one member's value.

Invariant: `out[:safe]` only grows (what a caller streamed from it stays a prefix of the
final text), and `out[:safe] + closing()` is valid JSON text of the value's shape.
"""

from __future__ import annotations

import json
import re

_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?\Z")
_LITERALS = ("true", "false", "null")
_SCALAR_CHARS = frozenset("0123456789+-.eEtrufalsn")
_STRING_RUN = re.compile(r'[^"\\\x00-\x1f]+')
_HEX = frozenset("0123456789abcdefABCDEF")
_ESCAPES = frozenset('"\\/bfnrtu')

# what the scanner expects next, outside strings and scalars
VALUE, KEY_OR_END, KEY, COLON, COMMA_OR_END, VALUE_OR_END, DONE = range(7)
_SAFE_STATES = (KEY_OR_END, COMMA_OR_END, VALUE_OR_END, DONE)


class JsonScanner:
    """Reads one JSON value; `feed` returns how many characters it consumed (it stops at the
    end of the value, or before a character that makes the text invalid: then `failed`)."""

    def __init__(self, require_object: bool = True):
        self.require_object = require_object
        self.out = ""
        self.failed = False
        self.members: dict[str, tuple[int, int]] = {}
        self.current: tuple[str, int] | None = None  # (key, start) of the member being read
        self._closers = ""  # innermost last
        self._expect = VALUE
        self._in_str = False
        self._str_is_key = False
        self._esc = 0  # 1 after a backslash, 2..5 inside \\uXXXX
        self._scalar = ""
        self._key = ""
        self._safe = (0, "", False)  # (length of out, closers, inside a string value)

    @property
    def done(self) -> bool:
        return self._expect == DONE and not self._scalar

    @property
    def started(self) -> bool:
        return bool(self.out)

    @property
    def safe_len(self) -> int:
        return self._safe[0]

    def closing(self) -> str:
        """The suffix that makes out[:safe_len] valid JSON ('' once done)."""
        _, closers, in_str = self._safe
        return ('"' if in_str else "") + closers[::-1]

    def feed(self, text: str) -> int:
        parts: list[str] = []
        self._n = len(self.out)
        self._parts = parts
        i, end = 0, len(text)
        while i < end and not self.failed and not self.done:
            if self._in_str:
                i = self._string(text, i)
                continue
            c = text[i]
            if self._scalar:
                if c in _SCALAR_CHARS:
                    self._scalar += c
                    self._put(c)
                    i += 1
                    continue
                if not self._end_scalar():
                    break
                continue  # re-read c after the scalar
            if not self._structural(c):
                self.failed = True
                break
            i += 1
        out, self.out = self.out, ""
        out += "".join(parts)  # a sole reference: CPython grows it in place (no O(n) copy)
        self.out = out
        return i

    # -- internals -------------------------------------------------------------------------

    def _put(self, s: str) -> None:
        self._parts.append(s)
        self._n += len(s)

    def _mark_safe(self) -> None:
        self._safe = (self._n, self._closers, False)

    def _string(self, text: str, i: int) -> int:
        if self._esc:
            c = text[i]
            if self._esc == 1:
                if c not in _ESCAPES:
                    self.failed = True
                    return i
                self._esc = 2 if c == "u" else 0
            elif c in _HEX:
                self._esc = 0 if self._esc == 5 else self._esc + 1
            else:
                self.failed = True
                return i
            self._put(c)
            if self._str_is_key:
                self._key += c
            elif not self._esc:
                self._safe = (self._n, self._closers, True)
            return i + 1
        m = _STRING_RUN.match(text, i)
        if m:
            run = m.group()
            self._put(run)
            if self._str_is_key:
                self._key += run
            else:
                self._safe = (self._n, self._closers, True)
            return m.end()
        c = text[i]
        if c == "\\":
            self._esc = 1
            self._put(c)
            if self._str_is_key:
                self._key += c
        elif c == '"':
            self._put(c)
            self._in_str = False
            if self._str_is_key:
                self._expect = COLON
            else:
                self._after_value()
        else:  # a raw control character: write it escaped
            esc = json.dumps(c)[1:-1]
            self._put(esc)
            if self._str_is_key:
                self._key += esc
            else:
                self._safe = (self._n, self._closers, True)
        return i + 1

    def _end_scalar(self) -> bool:
        s = self._scalar
        if s not in _LITERALS and not _NUMBER.match(s):
            self.failed = True
            return False
        self._scalar = ""
        self._after_value()
        return True

    def _begin_value(self) -> None:
        if len(self._closers) == 1 and self._closers == "}":
            self.current = (self._decoded_key(), self._n)

    def _decoded_key(self) -> str:
        try:
            return json.loads('"' + self._key + '"')
        except ValueError:
            return self._key

    def _after_value(self) -> None:
        if not self._closers:
            self._expect = DONE
            self._mark_safe()
            return
        if len(self._closers) == 1 and self.current is not None and self._closers == "}":
            key, start = self.current
            self.members[key] = (start, self._n)
            self.current = None
        self._expect = COMMA_OR_END
        self._mark_safe()

    def _structural(self, c: str) -> bool:
        """Handles one character outside strings and scalars; False when it is invalid."""
        exp = self._expect
        if c in " \t\r\n":
            if self._n:  # leading whitespace is not part of the value
                self._put(c)
                if exp in _SAFE_STATES:
                    self._mark_safe()
            return True
        if exp in (VALUE, VALUE_OR_END):
            if not self._closers and not self._n and self.require_object and c != "{":
                return False
            if c == "]" and exp == VALUE_OR_END:
                return self._close(c)
            if c in "{[":
                self._begin_value()
                self._put(c)
                self._closers += "}" if c == "{" else "]"
                self._expect = KEY_OR_END if c == "{" else VALUE_OR_END
                self._mark_safe()
                return True
            if c == '"':
                self._begin_value()
                self._put(c)
                self._in_str, self._str_is_key = True, False
                self._safe = (self._n, self._closers, True)
                return True
            if c in "-0123456789tfn":
                self._begin_value()
                self._scalar = c
                self._put(c)
                return True
            return False
        if exp in (KEY_OR_END, KEY) and c == '"':
            self._put(c)
            self._in_str, self._str_is_key, self._key = True, True, ""
            return True
        if exp == KEY_OR_END and c == "}":
            return self._close(c)
        if exp == COLON and c == ":":
            self._put(c)
            self._expect = VALUE
            return True
        if exp == COMMA_OR_END:
            if c == ",":
                self._put(c)
                self._expect = KEY if self._closers[-1] == "}" else VALUE
                return True
            if c in "}]":
                return self._close(c)
        return False

    def _close(self, c: str) -> bool:
        if not self._closers or self._closers[-1] != c:
            return False
        self._put(c)
        self._closers = self._closers[:-1]
        self._after_value()
        return True
