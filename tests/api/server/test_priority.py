"""The request `priority` (vLLM's) through every HTTP API into the core, and the scheduler's
metrics (preemptions by cause, the step-time target, the step cost model's error)."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.api.server.conftest import running_server
from tests.api.server.test_metrics import scrape


@pytest.fixture(scope="module")
def seen():
    """A server whose core runs in this process, recording each added request's priority."""
    with running_server(in_process=True) as srv:
        core, got = srv.engine.core, {}
        add = core.add

        def recording_add(msg):
            got[msg.request_id] = msg.priority
            return add(msg)

        core.add = recording_add
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0,
                               timeout=60)
        yield srv, client, got


def test_priority_reaches_the_core_from_each_api(seen):
    srv, client, got = seen
    chat = client.chat.completions.create(
        model=srv.model, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        extra_body={"priority": -2, "ignore_eos": True})
    assert got[chat.id] == -2
    comp = client.completions.create(model=srv.model, prompt="hello", max_tokens=3,
                                     extra_body={"priority": 5, "ignore_eos": True})
    assert got[comp.id] == 5
    plain = client.completions.create(model=srv.model, prompt="hello", max_tokens=2)
    assert got[plain.id] == 0
    r = httpx.post(srv.url + "/v1/messages", json={
        "model": srv.model, "max_tokens": 2, "priority": 7,
        "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
    assert r.status_code == 200 and got[r.json()["id"]] == 7
    r = httpx.post(srv.url + "/v1/responses", json={
        "model": srv.model, "max_output_tokens": 2, "priority": 3, "input": "hi"}, timeout=60)
    assert r.status_code == 200 and 3 in got.values()


def test_scheduler_metrics_are_exported(seen):
    srv, client, _ = seen
    client.completions.create(model=srv.model, prompt="count", max_tokens=8,
                              extra_body={"ignore_eos": True})
    srv.wait_idle()
    m = scrape(srv)
    assert m["loomserve_step_cost_samples_total"] >= 8
    # No step-time target is set (the default, 0: off), and a few short requests on an 8 MiB
    # cache never run out of blocks: no preemptions, of either cause.
    assert m["loomserve_target_step_seconds"] == 0.0
    assert m["loomserve_num_preemptions_total"] == 0
    text = httpx.get(srv.url + "/metrics").text
    for cause in ("decode_blocks", "prefill_blocks"):
        (line,) = [ln for ln in text.splitlines()
                   if ln.startswith("loomserve_num_preemptions_by_cause_total{")
                   and f'cause="{cause}"' in ln]
        assert float(line.rsplit(" ", 1)[1]) == 0, line
    errors = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("loomserve_step_cost_relative_error{")]
    assert len(errors) == 2 and all(e >= 0 for e in errors) and errors[0] <= errors[1]


def test_scheduler_flags_map_to_the_config():
    from loomserve.cli import build_parser, engine_config_from_args
    from loomserve.config import EngineConfig

    def config(*flags):
        return engine_config_from_args(build_parser().parse_args(["serve", "m", *flags]))

    default = config().scheduler
    assert (default.scheduling_policy, default.target_step_ms, default.max_postpone_ms) == \
        ("cache_aware", 0.0, 10_000.0)
    assert config("--target-step-ms", "auto").scheduler.target_step_ms is None
    c = config("--target-step-ms", "0", "--scheduling-policy", "fcfs", "--max-postpone-ms", "500")
    assert c == EngineConfig.from_kwargs(model="m", target_step_ms=0.0, scheduling_policy="fcfs",
                                         max_postpone_ms=500.0)
    with pytest.raises(SystemExit):
        config("--target-step-ms", "-3")
    with pytest.raises(ValueError):
        EngineConfig.from_kwargs(scheduling_policy="lifo")
