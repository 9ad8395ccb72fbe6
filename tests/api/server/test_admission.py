"""Admission and access: a full waiting queue answers 429 with Retry-After; API keys guard
every route but /health and /metrics; both hold with the core in-process too."""

from __future__ import annotations

import os
import threading

import httpx
import openai
import pytest

from loomserve.cli import build_parser
from tests.api.server.conftest import running_server
from tests.api.server.test_metrics import scrape
from tests.api.server.test_supervision import ANSWER_S, long_body, wait_for


@pytest.mark.parametrize("in_process", [False, True], ids=["core-process", "in-process"])
def test_a_full_waiting_queue_answers_429_and_loses_nothing(in_process):
    env = {"LOOMSERVE_STEP_DELAY_MS": "20"}
    with running_server(in_process=in_process, core_env=env, max_num_seqs=1,
                        max_waiting_requests=1) as srv:
        assert srv.engine.ready.max_waiting_requests == 1
        results = {}

        def send(name):
            results[name] = httpx.post(srv.url + "/v1/completions", timeout=ANSWER_S * 6,
                                       json=long_body(srv.model, False, 40))

        running = threading.Thread(target=send, args=("running",))
        running.start()
        wait_for(lambda: srv.engine.stats().num_running == 1, ANSWER_S)
        waiting = threading.Thread(target=send, args=("waiting",))
        waiting.start()
        wait_for(lambda: srv.engine.stats().num_waiting == 1, ANSWER_S)
        refused = httpx.post(srv.url + "/v1/completions", timeout=ANSWER_S,
                             json=long_body(srv.model, False, 4))
        assert refused.status_code == 429, refused.text
        assert refused.headers["retry-after"] == "1"
        err = refused.json()["error"]
        assert err["type"] == "rate_limit_error" and err["code"] == "too_many_waiting_requests"
        for t in (running, waiting):
            t.join(timeout=ANSWER_S * 6)
        assert [results[k].status_code for k in ("running", "waiting")] == [200, 200]
        # ignore_eos: each ran its full 40 tokens, none cut short by the refusal
        assert [results[k].json()["usage"]["completion_tokens"] for k in results] == [40, 40]
        s = srv.wait_idle()
        assert s.num_rejected == 1
        assert scrape(srv)["loomserve_num_requests_rejected_total"] == 1
        ok = httpx.post(srv.url + "/v1/completions", json=long_body(srv.model, False, 2),
                        timeout=ANSWER_S * 2)
        assert ok.status_code == 200


def test_api_key_guards_every_route_but_health_and_metrics(keyed_server):
    url, model = keyed_server.url, keyed_server.model
    body = {"model": model, "prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"},
                    {"x-api-key": "nope"}):
        r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=ANSWER_S)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
    for path in ("/v1/models", "/v1/models/" + model):
        assert httpx.get(url + path, timeout=ANSWER_S).status_code == 401
    assert httpx.delete(url + "/v1/sessions/s1", timeout=ANSWER_S).status_code == 401
    assert httpx.get(url + "/health", timeout=ANSWER_S).status_code == 200
    assert httpx.get(url + "/metrics", timeout=ANSWER_S).status_code == 200
    for headers in ({"Authorization": "Bearer sekrit"}, {"x-api-key": "sekrit"}):
        r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=ANSWER_S * 2)
        assert r.status_code == 200, r.text
    r = httpx.delete(url + "/v1/sessions/s1", headers={"Authorization": "Bearer sekrit"})
    assert r.status_code == 200


def test_the_official_client_with_the_key_works_and_without_it_fails(keyed_server):
    good = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key="sekrit", max_retries=0)
    out = good.completions.create(model=keyed_server.model, prompt="hi", max_tokens=2,
                                  extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 2 and out.choices[0].finish_reason == "length"
    bad = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key="other", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_api_key_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("LOOMSERVE_API_KEY", "from-env")
    assert build_parser().parse_args(["serve"]).api_key == "from-env"
    assert build_parser().parse_args(["serve", "--api-key", "flag"]).api_key == "flag"
    monkeypatch.delenv("LOOMSERVE_API_KEY")
    assert build_parser().parse_args(["serve"]).api_key is None
    assert "LOOMSERVE_API_KEY" not in os.environ
