"""A real agent framework (the OpenAI Agents SDK, from PyPI) runs a two-step tool task against a
real `loomserve serve` on the tiny random-weight fixture `tiny-agent`.

Constrained decoding makes a random model finish the task deterministically: step 1 is a call
of the tool the agent names in tool_choice (the grammar forces the call and its arguments'
schema), step 2 is the final answer under the output type's JSON schema (response_format /
text.format). parallel_tool_calls=False: the grammar ends step 1 after one call (a random
model would otherwise keep calling until max_tokens). The SDK resets tool_choice after a tool
ran, so the second request offers the tools with tool_choice auto and the schema; the grammar
then admits only the schema's JSON.
Through the Responses API (the SDK's default model) and Chat Completions.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from typing import Literal

import httpx
import pytest
from pydantic import BaseModel

from tests.api.server.test_supervision import free_port, health, wait_for

agents = pytest.importorskip("agents")

TINY_AGENT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "fixtures",
                                          "tiny-agent"))
FILES = ("notes.txt", "todo.txt")
CONTENTS = {"notes.txt": "The launch is on Tuesday.", "todo.txt": "1. write the tests"}


class Answer(BaseModel):
    """The agent's final output: which file it read and whether it found what it needed."""
    file: Literal["notes.txt", "todo.txt"]
    found: bool


@pytest.fixture(scope="module")
def server():
    """`python -m loomserve serve tests/fixtures/tiny-agent`, as a user starts it."""
    if not os.path.isdir(TINY_AGENT):
        pytest.skip("tests/fixtures/tiny-agent is missing")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "loomserve", "serve", TINY_AGENT, "--port", str(port),
         "--dtype", "float32", "--kv-cache-memory", "64MiB", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: proc.poll() is not None or health(url) == 200, 60)
        assert proc.poll() is None, proc.stdout.read()
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        yield url, model
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def reader_agent(model, ran: list[str]):
    """An agent whose first step must call read_file and whose answer is an `Answer`."""
    from agents import Agent, ModelSettings, function_tool

    @function_tool
    def read_file(path: Literal["notes.txt", "todo.txt"]) -> str:
        """Read one of the user's files."""
        ran.append(path)  # the SDK ran the tool with arguments that passed its schema
        return CONTENTS[path]

    return Agent(name="reader", model=model, tools=[read_file], output_type=Answer,
                 instructions="Read the user's notes with read_file, then answer.",
                 # one call per step: the grammar then ends the output after it
                 model_settings=ModelSettings(tool_choice="read_file", parallel_tool_calls=False,
                                              temperature=0, max_tokens=96))


def run_task(url: str, model_name: str, api: str):
    from agents import (
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # no trace upload to OpenAI: the test runs offline
    client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    cls = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
    ran: list[str] = []
    agent = reader_agent(cls(model=model_name, openai_client=client), ran)
    result = asyncio.run(Runner.run(agent, "What do my notes say?", max_turns=3))
    return result, ran


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_agents_sdk_runs_a_forced_tool_call_then_a_structured_answer(server, api):
    from agents import ItemHelpers
    from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem

    url, model_name = server
    result, ran = run_task(url, model_name, api)

    assert len(ran) == 1 and ran[0] in FILES, ran  # step 1: the tool really ran, once
    kinds = [type(item) for item in result.new_items]
    assert kinds == [ToolCallItem, ToolCallOutputItem, MessageOutputItem], kinds
    call, output = result.new_items[0], result.new_items[1]
    assert call.raw_item.name == "read_file"
    assert output.output == CONTENTS[ran[0]]  # the tool's result went back to the model
    # step 2: the final output is the schema's JSON, validated into Answer by the SDK
    assert isinstance(result.final_output, Answer)
    text = ItemHelpers.text_message_output(result.new_items[2])
    assert Answer.model_validate_json(text) == result.final_output
    assert len(result.raw_responses) == 2
    for response in result.raw_responses:
        assert response.usage.input_tokens > 0 and response.usage.output_tokens > 0
    assert health(url) == 200
