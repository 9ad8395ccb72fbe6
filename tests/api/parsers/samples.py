"""Recorded outputs in each family's documented format, with what they must parse to.

Each sample: (parser, text, content, [(name, arguments as a Python value), ...]). Written from
the formats' documentation and chat templates (Qwen2.5/3, Hermes, SmolLM2, Qwen3-Coder, Llama
3.1, Mistral v3 and v11 tokenizers, DeepSeek-V3 / V3.1, DeepSeek-V3.2's DSML, Kimi-K2, GLM-4.5,
MiniMax-M2, gpt-oss harmony).
"""

from __future__ import annotations

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                   "metric": {"type": "boolean"}, "hours": {"type": "array"},
                   "opts": {"type": "object"}, "zip": {"type": "string"}},
}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "number"}},
}}}
TOOLS = [WEATHER, SEARCH]

PARIS = ("get_weather", {"city": "Paris", "days": 3})
CODE = 'def f(x):\n    return "a\\tb" + x  # {not json}\n'

SAMPLES = [
    # -- hermes (Qwen2.5 / Qwen3 / Hermes 3; SmolLM2's list) --------------------------------
    ("hermes", 'I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
     '"Paris", "days": 3}}\n</tool_call>', "I will check.\n", [PARIS]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
     '\n</tool_call>\n<tool_call>\n{"name": "search", "arguments": {"query": "caf\\u00e9 \\"x\\"",'
     ' "limit": 2.5e1}}\n</tool_call>\n', "",
     [PARIS, ("search", {"query": 'café "x"', "limit": 25.0})]),
    ("hermes", '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
     '{"name": "search", "arguments": {"query": "q"}}]</tool_call>', "",
     [PARIS, ("search", {"query": "q"})]),
    ("hermes", '<tool_call>\n{"arguments": {"query": "order"}, "name": "search"}\n</tool_call>',
     "", [("search", {"query": "order"})]),
    ("hermes", '<tool_call>\n{"name": "search", "arguments": "{\\"query\\": \\"s\\"}"}\n'
     '</tool_call>', "", [("search", {"query": "s"})]),
    ("hermes", 'raw newline: <tool_call>{"name": "search", "arguments": {"query": "a\nb"}}'
     '</tool_call> done', "raw newline: done", [("search", {"query": "a\nb"})]),
    ("hermes", "No tools: 1 < 2 and <tool> is not <tool_call", "No tools: 1 < 2 and <tool> is "
     "not <tool_call", []),
    ("hermes", 'Bad: <tool_call>\n{"nam": "x"}\n</tool_call>', 'Bad: <tool_call>\n{"nam": "x"}'
     '\n</tool_call>', []),
    # -- qwen3_coder -------------------------------------------------------------------------
    ("qwen3_coder", "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
     "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n"
     "<parameter=hours>\n[1, 2]\n</parameter>\n<parameter=opts>\n{'a': 1}\n</parameter>\n"
     "<parameter=zip>\n01234\n</parameter>\n</function>\n</tool_call>", "Checking.\n",
     [("get_weather", {"city": "Paris", "days": 3, "metric": True, "hours": [1, 2],
                       "opts": {"a": 1}, "zip": "01234"})]),
    ("qwen3_coder", "<tool_call>\n<function=search>\n<parameter=query>\n" + CODE +
     "\n</parameter>\n<parameter=limit>\nmany\n</parameter>\n</function>\n</tool_call>\n"
     "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>\n3\n"
     "</function>\n</tool_call>", "",
     [("search", {"query": CODE, "limit": "many"}), PARIS]),
    ("qwen3_coder", "<tool_call>\n<function=search>\n</function>\n</tool_call>", "",
     [("search", {})]),
    # -- llama3_json -------------------------------------------------------------------------
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', "",
     [PARIS]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", '
     '"days": 3}}; {"name": "search", "parameters": {"query": "q"}}', "",
     [PARIS, ("search", {"query": "q"})]),
    ("llama3_json", 'Sure: {"name": "search", "parameters": {"query": "q"}}', "Sure: ",
     [("search", {"query": "q"})]),
    ("llama3_json", '{"name": "Bob", "age": 3} is a JSON object.', '{"name": "Bob", "age": 3} '
     "is a JSON object.", []),
    # -- mistral -----------------------------------------------------------------------------
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}},'
     ' {"name": "search", "arguments": {"query": "q"}}]', "",
     [PARIS, ("search", {"query": "q"})]),
    ("mistral", 'Let me look.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}'
     '[TOOL_CALLS]search[CALL_ID]a1b2c3d4e[ARGS]{"query": "q"}', "Let me look.",
     [PARIS, ("search", {"query": "q"})]),
    ("mistral", "[TOOL_CALLS] not really a call, sorry", "[TOOL_CALLS] not really a call, sorry",
     []),
    # -- deepseek_v3 -------------------------------------------------------------------------
    ("deepseek_v3", "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
     'get_weather\n```json\n{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜>\n'
     "<｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n{\"query\": \"q\"}\n```"
     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "Checking.",
     [PARIS, ("search", {"query": "q"})]),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
     '{"city": "Paris", "days": 3}<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "", [PARIS]),
    # -- kimi_k2 -----------------------------------------------------------------------------
    ("kimi_k2", "On it.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
     '<|tool_call_argument_begin|>{"city": "Paris", "days": 3}<|tool_call_end|>'
     "<|tool_call_begin|>functions.search:1<|tool_call_argument_begin|>{\"query\": \"q\"}"
     "<|tool_call_end|><|tool_calls_section_end|>", "On it.",
     [PARIS, ("search", {"query": "q"})]),
    ("kimi_k2", "<|tool_calls_section_begin|> <|tool_call_begin|> functions.search:3 "
     '<|tool_call_argument_begin|> {"query": "q"} <|tool_call_end|> <|tool_calls_section_end|>',
     "", [("search", {"query": "q"})]),
    # -- glm45 -------------------------------------------------------------------------------
    ("glm45", "Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris"
     "</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>\n"
     "<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>" + CODE + "</arg_value>\n"
     "</tool_call>", "Checking.\n", [PARIS, ("search", {"query": CODE})]),
    ("glm45", "<tool_call>search</tool_call>", "", [("search", {})]),
    # GLM-4.7 writes no newlines between the name and the pairs
    ("glm45", "Look: <tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
     "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call> then", "Look: then", [PARIS]),
    # -- minimax_m2 --------------------------------------------------------------------------
    ("minimax_m2", 'Checking.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter '
     'name="city">Paris</parameter>\n<parameter name="days">3</parameter>\n</invoke>\n<invoke '
     'name="search">\n<parameter name="query">\n' + CODE + '</parameter>\n</invoke>\n'
     "</minimax:tool_call>", "Checking.\n", [PARIS, ("search", {"query": CODE.strip()})]),
    ("minimax_m2", '<minimax:tool_call>\n<invoke name="search">\n</invoke>\n</minimax:tool_call>'
     "\n\nDone.", "Done.", [("search", {})]),
    # quoted and bare names, a missing </parameter>, two blocks
    ("minimax_m2", "<minimax:tool_call><invoke name='get_weather'><parameter name=city>Paris"
     '<parameter name="days">3</invoke></minimax:tool_call> and <minimax:tool_call>\n<invoke '
     'name="search"><parameter name="query">a < b</parameter></invoke></minimax:tool_call>',
     "and ", [PARIS, ("search", {"query": "a < b"})]),
    # -- deepseek_v32 (DSML) ----------------------------------------------------------------
    # as DeepSeek's encoder writes it: "\n\n" before the block, string="true" values verbatim
    ("deepseek_v32", "Checking.\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
     '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n<｜DSML｜parameter '
     'name="days" string="false">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n<｜DSML｜invoke '
     'name="search">\n<｜DSML｜parameter name="query" string="true">' + CODE +
     "</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>", "Checking.\n\n",
     [PARIS, ("search", {"query": CODE})]),
    ("deepseek_v32", '<｜DSML｜function_calls>\n<｜DSML｜invoke name="search">\n</｜DSML｜invoke>\n'
     "</｜DSML｜function_calls>\n\nDone.", "Done.", [("search", {})]),
    # JSON values typed by the flag where the schema does not say (an unknown parameter), a
    # missing </｜DSML｜parameter> and </｜DSML｜invoke>
    ("deepseek_v32", '<｜DSML｜function_calls><｜DSML｜invoke name="search"><｜DSML｜parameter '
     'name="filters" string="false">{"site": "a.b", "n": [1]}</｜DSML｜parameter><｜DSML｜'
     'parameter name="query" string="true">a < b<｜DSML｜invoke name="get_weather"><｜DSML｜'
     'parameter name="city" string="true">Paris</｜DSML｜parameter><｜DSML｜parameter name="days" '
     'string="false">3</｜DSML｜function_calls> and DSML｜ text', "and DSML｜ text",
     [("search", {"filters": {"site": "a.b", "n": [1]}, "query": "a < b"}), PARIS]),
    # -- harmony (gpt-oss) -------------------------------------------------------------------
    ("harmony", "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
     "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
     '{"city": "Paris", "days": 3}<|call|>', "", [PARIS]),
    ("harmony", "<|channel|>analysis<|message|>Simple.<|end|><|start|>assistant<|channel|>final"
     "<|message|>It is <b>sunny</b> <| not a marker.<|return|>", "It is <b>sunny</b> <| not a "
     "marker.", []),
    ("harmony", "<|channel|>analysis<|message|>Two.<|end|><|start|>assistant to=functions.search"
     '<|channel|>commentary json<|message|>{"query": "q"}<|call|>', "",
     [("search", {"query": "q"})]),
    ("harmony", "plain text, no harmony markup", "plain text, no harmony markup", []),
]

# reasoning the harmony samples carry (the analysis channel)
HARMONY_REASONING = {0: "Need the weather.", 1: "Simple.", 2: "Two.", 3: ""}
