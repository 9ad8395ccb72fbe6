"""The engine, as vLLM v1 draws it.

Client half, in the front end's process: async_llm.py (AsyncLLM, the server's way in), llm.py
(offline LLM), processor.py and tokenizer.py (prompts in, text out), core_client.py and the
data-parallel clients (dp_client.py, dp_remote.py, dp_rank.py), output.py. Core half, in the
engine core's process: core.py (EngineCore: schedule, execute, postprocess), core_loop.py (the
loop and its supervision), core_proc.py (the process), messages.py (every message between the
halves, msgspec over ZMQ), executor/ (the handle on the worker ranks), sched/ (the scheduler),
faults.py and step_trace.py. Imports execution/, kv/ and config. Design: docs/design/overview.md,
scheduler.md, parallelism.md.
"""
