"""Grammar-constrained decoding: a random tiny model's output always follows the json schema,
regex or tool-call grammar; bad specs fail validation without a tokenizer; matchers are freed
on abort and survive preemption."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from loomserve.execution.logits_processors import apply_bitmask
from loomserve.execution.structured import compile_spec, validate_structured
from loomserve.sampling_params import (
    CallFormat,
    SamplingParams,
    StructuredOutputs,
    ToolCallGrammar,
)
from tests.execution.conftest import TINY_LLAMA, make_llm

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "kind": {"enum": ["cat", "dog"]},
    "ok": {"type": "boolean"},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["name", "kind", "ok", "tags"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
        "additionalProperties": False}
PROMPT = [1, 17, 33, 90, 12]


def hermes(name: str, schema: dict) -> CallFormat:
    return CallFormat(f'<tool_call>\n{{"name": "{name}", "arguments": ', json.dumps(schema),
                      "}\n</tool_call>")


CALLS = [hermes("get_weather", WEATHER), hermes("get_time", TIME)]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


@pytest.fixture(scope="module")
def llm():
    engine = make_llm()
    yield engine
    engine.close()


def _sampled(n: int, structured: StructuredOutputs, max_tokens: int = 120) -> list[SamplingParams]:
    return [SamplingParams(temperature=1.0, seed=s, max_tokens=max_tokens, structured=structured)
            for s in range(n)]


def _check_call(text: str) -> None:
    m = re.fullmatch(r'<tool_call>\n\{"name": "(\w+)", "arguments": (.*)\}\n</tool_call>', text,
                     re.S)
    assert m, text
    jsonschema.validate(json.loads(m.group(2)), SCHEMAS[m.group(1)])


# -- validation, no tokenizer -----------------------------------------------------------------

@pytest.mark.parametrize("spec, message", [
    (StructuredOutputs(json_schema="{not json"), "not valid JSON"),
    (StructuredOutputs(json_schema="[1, 2]"), "JSON object"),
    (StructuredOutputs(json_schema='{"type": "object", "properties": {"a": {"type": 5}}}'),
     "invalid json schema"),
    (StructuredOutputs(regex="a(b"), "invalid regex"),
    (StructuredOutputs(), "exactly one"),
    (StructuredOutputs(regex="a", json_object=True), "exactly one"),
    (StructuredOutputs(tool_calls=ToolCallGrammar(calls=[])), "at least one"),
    (StructuredOutputs(tool_calls=ToolCallGrammar(calls=[CallFormat("<t>", "{bad", "</t>")])),
     "not valid JSON"),
    (StructuredOutputs(tool_calls=ToolCallGrammar(calls=CALLS, required=False,
                                                  triggers=["<call>"])), "trigger"),
])
def test_invalid_specs_raise_value_error(spec, message):
    with pytest.raises(ValueError, match=message):
        validate_structured(spec)


def test_valid_specs_pass():
    validate_structured(StructuredOutputs(json_schema=json.dumps(SCHEMA)))
    validate_structured(StructuredOutputs(json_object=True))
    validate_structured(StructuredOutputs(regex=r"[a-c]{2}\d+"))
    validate_structured(StructuredOutputs(tool_calls=ToolCallGrammar(calls=CALLS)))


def test_invalid_schema_is_a_value_error_from_generate(llm):
    with pytest.raises(ValueError, match="json_schema is not valid JSON"):
        llm.generate(PROMPT, SamplingParams(structured=StructuredOutputs(json_schema="{")))


# -- the grammar itself, on the tiny tokenizer ----------------------------------------------------

@pytest.fixture(scope="module")
def compiler():
    import xgrammar as xgr

    from loomserve.engine.tokenizer import Tokenizer
    hf = Tokenizer.from_folder(TINY_LLAMA).hf
    return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(hf, vocab_size=512))


def _accepts(compiler, spec: StructuredOutputs, text: str) -> bool:
    import xgrammar as xgr
    m = xgr.GrammarMatcher(compile_spec(compiler, spec))
    return m.accept_string(text) and m.is_completed()


def test_tool_call_grammar_shapes(compiler):
    one = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
    two = one + "\n" + one.replace("UTC", "CET")
    required = StructuredOutputs(tool_calls=ToolCallGrammar(calls=CALLS))
    assert _accepts(compiler, required, one) and _accepts(compiler, required, two)
    assert not _accepts(compiler, required, "hello " + one)
    assert not _accepts(compiler, required, one.replace('"UTC"', '"PST"'))
    single = StructuredOutputs(tool_calls=ToolCallGrammar(calls=CALLS, parallel=False))
    assert _accepts(compiler, single, one) and not _accepts(compiler, single, two)
    auto = StructuredOutputs(tool_calls=ToolCallGrammar(calls=CALLS, required=False,
                                                        triggers=["<tool_call>"]))
    assert _accepts(compiler, auto, "just text")
    assert _accepts(compiler, auto, "let me check\n" + one)
    assert not _accepts(compiler, auto, "let me check\n<tool_call>\n{\"name\": \"nope\"")


def test_bitmask_disallows_ids_beyond_its_width():
    logits = torch.zeros(2, 70)
    bitmask = torch.full((1, 2), -1, dtype=torch.int32)  # 64 ids allowed, the rest not covered
    apply_bitmask(logits, bitmask, [1], [0])
    assert torch.isinf(logits[1, 64:]).all() and not torch.isinf(logits[1, :64]).any()
    assert not torch.isinf(logits[0]).any()  # rows without a grammar are untouched


# -- generation with the random tiny model --------------------------------------------------------

def test_json_schema_output_always_validates(llm):
    spec = StructuredOutputs(json_schema=json.dumps(SCHEMA))
    outs = llm.generate([PROMPT] * 6, _sampled(6, spec))
    vocab = len(llm.tokenizer.hf)
    for o in outs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), SCHEMA)
        assert all(t < vocab for t in o.token_ids)  # logits wider than the vocab: masked


def test_regex_output_matches(llm):
    pattern = r"(yes|no)-[a-d]{2,4}-\d{3}"
    outs = llm.generate([PROMPT] * 4, _sampled(4, StructuredOutputs(regex=pattern), 40))
    for o in outs:
        assert re.fullmatch(pattern, o.text), o.text


def test_required_tool_calls_are_begin_json_end(llm):
    single = StructuredOutputs(tool_calls=ToolCallGrammar(calls=CALLS, parallel=False))
    for o in llm.generate([PROMPT] * 2, _sampled(2, single, 100)):
        assert o.finish_reason == "stop"
        _check_call(o.text)
    parallel = StructuredOutputs(tool_calls=ToolCallGrammar(calls=CALLS, separator="\n"))
    for o in llm.generate([PROMPT], _sampled(1, parallel, 120)):
        if o.finish_reason == "stop":
            for part in re.split(r"(?<=</tool_call>)\n", o.text):
                _check_call(part)


def test_greedy_structured_beside_plain_requests(llm):
    spec = StructuredOutputs(json_schema=json.dumps(SCHEMA))
    plain = SamplingParams(temperature=0.0, max_tokens=10)
    alone = llm.generate(PROMPT, plain)[0].token_ids
    outs = llm.generate([PROMPT, PROMPT], [plain, SamplingParams(temperature=0.0, max_tokens=120,
                                                                 structured=spec)])
    assert outs[0].token_ids == alone
    jsonschema.validate(json.loads(outs[1].text), SCHEMA)


def test_preemption_keeps_output_valid():
    # 8 blocks of 16 tokens: 5 requests preempt (fcfs and the token budget alone: the
    # step-time budget depends on measured step times, so only this mode is deterministic)
    engine = make_llm(kv_cache_memory="64KiB", scheduling_policy="fcfs", target_step_ms=0)
    try:
        spec = StructuredOutputs(json_schema=json.dumps(SCHEMA))
        outs = engine.generate([PROMPT] * 5, _sampled(5, spec, 100))
        assert engine.core.scheduler.num_preemptions > 0
        for o in outs:
            assert o.finish_reason == "stop", o.text
            jsonschema.validate(json.loads(o.text), SCHEMA)
    finally:
        engine.close()


def test_abort_frees_the_matcher(llm):
    core = llm.core
    spec = StructuredOutputs(json_schema=json.dumps(SCHEMA))
    msg = llm.inputs.make_core_request("abort-me", PROMPT, SamplingParams(max_tokens=50,
                                                                        structured=spec))
    core.add(msg)
    req = core.scheduler.requests["abort-me"]
    assert req.grammar is not None
    for _ in range(3):
        core.step()
    assert core.abort("abort-me")
    assert req.grammar is None and "abort-me" not in core.scheduler.requests
    while core.has_work():
        core.step()


def test_grammar_that_fails_to_compile_ends_its_request(llm):
    # Past the front end's validation (a message built by hand): the core aborts it, twice
    # (the second time from the cached failure), and keeps serving.
    from loomserve.engine.messages import EngineCoreRequest
    bad = SamplingParams(max_tokens=5, structured=StructuredOutputs(regex="a(b"))
    finished = {}
    for rid in ("bad-1", "bad-2"):
        llm.core.add(EngineCoreRequest(request_id=rid, prompt_token_ids=PROMPT, sampling=bad,
                                       max_tokens=5, eos_token_ids=[2]))
        while llm.core.has_work():
            for out in llm.core.step():
                if out.finished:
                    finished[out.request_id] = out.finish_reason
    assert finished == {"bad-1": "abort", "bad-2": "abort"}
    assert llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3))[0].finished


def test_min_tokens_yields_to_a_complete_grammar(llm):
    params = SamplingParams(temperature=0.0, max_tokens=60, min_tokens=50,
                            structured=StructuredOutputs(regex="ab"))
    out = llm.generate(PROMPT, params)[0]
    assert out.text == "ab" and out.finish_reason == "stop"


def test_bitmask_cpu_kernel_and_torch_path_agree():
    from loomserve.execution.logits_processors import apply_bitmask_torch
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 100, generator=g)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 4), dtype=torch.int32, generator=g)
    a, b = logits.clone(), logits.clone()
    apply_bitmask(a, bitmask, [0, 2, 4], [2, 0, 1])
    apply_bitmask_torch(b, bitmask, [0, 2, 4], [2, 0, 1], 100)
    assert torch.equal(a, b)
    assert torch.equal(a[[1, 3]], logits[[1, 3]])
    for row, brow in ((0, 2), (2, 0), (4, 1)):
        bits = [(int(bitmask[brow, t // 32]) >> (t % 32)) & 1 for t in range(100)]
        assert [not torch.isinf(a[row, t]).item() for t in range(100)] == [bool(x) for x in bits]


def test_ignore_eos_request_ends_when_its_grammar_does(llm):
    # With ignore_eos the grammar's stop token is the model's eos: accepting it ends the grammar,
    # and the request with it (the matcher is never asked for a mask past its end).
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                            structured=StructuredOutputs(regex="ab"))
    outs = llm.generate([PROMPT, PROMPT], [params, SamplingParams(temperature=0, max_tokens=30)])
    assert outs[0].text.startswith("ab") and outs[0].finish_reason == "stop"
    assert len(outs[0].token_ids) <= 3 and outs[1].finished
