"""Arguments written as tagged key/value pairs (Qwen3-Coder, GLM-4.5), turned into JSON text.

Each value is text; the tool's parameter schema types it: a string parameter stays a string,
number / integer / boolean / object / array / null values are parsed as JSON (object / array
also as a Python literal, which these models sometimes write) when that gives the type; anything
else, an unknown parameter included, stays a string. A format that says itself whether a value
is a string (DeepSeek-V3.2's string="true|false") decides where the schema does not: for an
untyped or unknown parameter, and between string and another type of a union.
"""

from __future__ import annotations

import ast
import json

_PY_TYPES = {
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
    "null": (type(None),),
}


def schema_types(prop: dict | None) -> set[str]:
    """The JSON types a property schema allows (type, or the types of anyOf / oneOf)."""
    if not isinstance(prop, dict):
        return set()
    t = prop.get("type")
    types = {t} if isinstance(t, str) else set(t) if isinstance(t, list) else set()
    for key in ("anyOf", "oneOf"):
        for sub in prop.get(key) or ():
            types |= schema_types(sub)
    if not types and "enum" in prop:
        types = {"string"} if all(isinstance(v, str) for v in prop["enum"]) else {"any"}
    return types


def convert_value(raw: str, prop: dict | None, is_string: bool | None = None):
    """The JSON value of one parameter's text, by its schema (and the format's string flag)."""
    types = schema_types(prop)
    if is_string is not None and (not types or "any" in types or
                                  ("string" in types and len(types) > 1)):
        if is_string:
            return raw
        try:  # written as JSON (NaN and Infinity are not JSON)
            return json.loads(raw, parse_constant=_not_json)
        except (ValueError, RecursionError):
            if not types or "any" in types:
                return raw
    if not types or types == {"string"}:
        return raw
    text = raw.strip()
    for parse in (json.loads, ast.literal_eval):
        try:
            value = parse(text)
        except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError):
            continue
        if "any" in types:
            return value
        for t in types:
            if isinstance(value, _PY_TYPES.get(t, ())) and not (
                t in ("integer", "number") and isinstance(value, bool)
            ):
                return value
    if "boolean" in types and text.lower() in ("true", "false"):
        return text.lower() == "true"
    return raw


def _not_json(name: str):
    raise ValueError(name)


class XmlArgs:
    """Builds a call's arguments as JSON object text, one complete parameter at a time.

    Invariant: text() + ('}' unless closed) is always a valid JSON object text."""

    def __init__(self, parameters: dict | None):
        props = (parameters or {}).get("properties")
        self._props = props if isinstance(props, dict) else {}
        self._text = "{"
        self.closed = False

    def add(self, key: str, raw: str, is_string: bool | None = None) -> None:
        value = convert_value(raw, self._props.get(key), is_string)
        sep = "" if self._text == "{" else ", "
        item = json.dumps(key, ensure_ascii=False) + ": " + json.dumps(value, ensure_ascii=False)
        self._text += sep + item

    def close(self) -> None:
        if not self.closed:
            self._text += "}"
            self.closed = True

    def text(self) -> str:
        return self._text
