"""StructuredOutputs -> an xgrammar grammar; validation that needs no tokenizer.

Why xgrammar 0.2.9 over llguidance 1.9.1 (benchmarks/grammar_mask.py: SmolLM2's 49,152-token
vocabulary, a 6-property JSON schema and a two-tool Hermes call grammar, 2-core AMD EPYC,
2026-12-01, the host shared with other jobs): per-token mask fill 0.01-0.02 ms for one stream and
0.5-3.8 ms for 32 (batched), against llguidance's 0.2-0.7 ms and 2.6-13.5 ms; fill + accept +
applying the mask at 32 streams is 2.5-7% of a 350 ms decode step with xgrammar, 4-30% with
llguidance (its apply also had 18-49 ms first-call outliers). llguidance compiles faster (2-21 ms
vs 32-62 ms), which the core's compile cache and worker thread hide. xgrammar's structural tags
also express the tool-call shapes (calls with a separator, triggered calls) directly.

JSON is generated with ", " and ": " separators and no free whitespace: a model cannot then
stall in whitespace until max_tokens.
"""

from __future__ import annotations

import json

from loomserve.sampling_params import StructuredOutputs, ToolCallGrammar

# Tool-call arguments allow the whitespace models write (pretty-printed, indented), bounded so a
# model cannot stall in it until max_tokens.
TOOL_JSON_MAX_SPACE = 8
_VALID: set[str] = set()  # spec keys that passed validation


def spec_key(spec: StructuredOutputs) -> str:
    """A stable key for the compiled-grammar cache."""
    tc = spec.tool_calls
    calls = None if tc is None else {
        "calls": [[c.begin, c.schema, c.end] for c in tc.calls], "required": tc.required,
        "sep": tc.separator, "triggers": tc.triggers, "parallel": tc.parallel}
    return json.dumps([spec.json_schema, spec.json_object, spec.regex, calls])


def _kind(spec: StructuredOutputs) -> str:
    set_ = [name for name, on in (("json_schema", spec.json_schema is not None),
                                  ("json_object", spec.json_object),
                                  ("regex", spec.regex is not None),
                                  ("tool_calls", spec.tool_calls is not None)) if on]
    if len(set_) != 1:
        raise ValueError("structured output needs exactly one of json_schema, json_object, "
                         f"regex, tool_calls; got {set_ or 'none'}")
    return set_[0]


def _schema(text: str, what: str) -> dict | bool:
    try:
        schema = json.loads(text)
    except (TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"{what} is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"{what} must be a JSON object (a JSON Schema)")
    return schema


def structural_tag(tc: ToolCallGrammar) -> dict:
    """xgrammar structural tag: required -> calls joined by the separator and nothing else;
    otherwise free text in which a trigger opens a call. parallel=False: at most one call."""
    if not tc.calls:
        raise ValueError("a tool-call grammar needs at least one call format")
    tags = [{"type": "tag", "begin": c.begin, "end": c.end,
             "content": {"type": "json_schema", "max_whitespace_cnt": TOOL_JSON_MAX_SPACE,
                         "json_schema": _bounded_strings(
                             _schema(c.schema, f"the schema of tool call {i}"))}}
            for i, c in enumerate(tc.calls)]
    if tc.required:
        fmt = {"type": "tags_with_separator", "tags": tags, "separator": tc.separator,
               "at_least_one": True, "stop_after_first": not tc.parallel}
    else:
        triggers = list(dict.fromkeys(tc.triggers or [c.begin for c in tc.calls]))
        for c in tc.calls:
            if sum(c.begin.startswith(t) for t in triggers) != 1:
                raise ValueError(f"tool call begin {c.begin!r} must start with exactly one "
                                 f"trigger of {triggers}")
        fmt = {"type": "triggered_tags", "triggers": triggers, "tags": tags,
               "at_least_one": False, "stop_after_first": not tc.parallel}
    return {"type": "structural_tag", "format": fmt}


def validate_structured(spec: StructuredOutputs) -> None:
    """Raise ValueError (a user-facing message) for a spec no grammar can be built from: not
    exactly one field, a schema that is not valid JSON or that xgrammar rejects, a bad regex.
    Needs no tokenizer: the grammar is built, not compiled against a vocabulary."""
    import xgrammar as xgr

    kind = _kind(spec)
    key = spec_key(spec)
    if key in _VALID:  # the same schema every turn of an agent: check it once
        return
    try:
        if kind == "json_schema":
            _schema(spec.json_schema, "json_schema")
            xgr.Grammar.from_json_schema(_patched(spec.json_schema), any_whitespace=False)
        elif kind == "regex":
            xgr.Grammar.from_regex(spec.regex)
        elif kind == "tool_calls":
            xgr.Grammar.from_structural_tag(json.dumps(structural_tag(spec.tool_calls)))
    except ValueError:
        raise
    except Exception as e:  # xgrammar reports bad schemas / regexes as RuntimeError etc.
        raise ValueError(f"invalid {kind.replace('_', ' ')}: {_first_line(e)}") from None
    if len(_VALID) >= 1024:
        _VALID.clear()
    _VALID.add(key)


def _bounded_strings(node):
    """xgrammar 0.2.9 writes a string with minLength / maxLength as {m,n} of any character but
    quote, backslash, CR, LF: other control characters get through (invalid JSON). Its regex
    path does exclude them, so such a string becomes the equivalent pattern ^.{m,n}$
    (without escapes: a bounded string is generated with plain characters only)."""
    if isinstance(node, list):
        return [_bounded_strings(x) for x in node]
    if not isinstance(node, dict):
        return node
    node = {k: _bounded_strings(v) for k, v in node.items()}
    if (node.get("type") == "string" and ("maxLength" in node or "minLength" in node)
            and not {"pattern", "format", "enum", "const"} & node.keys()):
        lo, hi = node.pop("minLength", 0), node.pop("maxLength", "")
        node["pattern"] = f"^.{{{lo},{hi}}}$"
    return node


def _patched(schema_text: str) -> str:
    return json.dumps(_bounded_strings(json.loads(schema_text)))


def compile_spec(compiler, spec: StructuredOutputs):
    """The CompiledGrammar for `spec` (compiler: an xgrammar GrammarCompiler)."""
    kind = _kind(spec)
    if kind == "json_schema":
        return compiler.compile_json_schema(_patched(spec.json_schema), any_whitespace=False)
    if kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
    if kind == "regex":
        return compiler.compile_regex(spec.regex)
    return compiler.compile_structural_tag(json.dumps(structural_tag(spec.tool_calls)))


def _first_line(e: Exception) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:300]
