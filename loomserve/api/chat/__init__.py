"""The API-neutral chat layer shared by Chat Completions, Anthropic Messages and Responses.

Each API converts its own request into a `ChatRequest` (messages in the neutral shape below,
tools, tool_choice, response_format), and `ChatFrontend.prepare` turns it into prompt token
ids, the grammar the output must follow (SamplingParams.structured) and a factory of output
parsers; each API then maps the parser's events (events.py) to its own wire format.

Neutral message shape (what HF chat templates read):
  {"role": "system" | "developer" | "user" | "assistant" | "tool",
   "content": str,                          # text; "" when absent
   "reasoning_content": str,                # assistant, optional: reasoning passed back
   "tool_calls": [{"id": str, "type": "function",
                   "function": {"name": str, "arguments": str}}],  # assistant, optional;
                                            # arguments: JSON object text, as the client sent it
   "tool_call_id": str, "name": str}        # tool: the call it answers (and its name if known)
Neutral tool shape: {"type": "function", "function": {"name", "description", "parameters",
"strict"}} (OpenAI's). tool_choice: "auto" | "none" | "required" | {"type": "function",
"function": {"name": ...}}. response_format: None | {"type": "text"} | {"type": "json_object"}
| {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}.

Modules: events.py (parser events), validate.py (roles, content, tool schemas, tool_call ids,
tool_choice -> ChatInputError naming the field), render.py (messages + tools -> prompt through
the model's template, with a Hermes fallback for templates without tools), grammar.py
(tool_choice / response_format -> StructuredOutputs), frontend.py (ChatFrontend: the above in
order, parser choice), output_parser.py (reasoning + tool parsers chained over the generated
text).
"""
