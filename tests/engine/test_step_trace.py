"""The slow-step log: phases and shape of steps past the threshold, nothing below it."""

import logging
import time

from loomserve.engine.step_trace import StepTrace


def _step(trace: StepTrace, sleep_s: float) -> None:
    trace.begin()
    trace.mark("poll")
    time.sleep(sleep_s)
    trace.mark("execute")
    trace.end("seqs=2 new_tokens=3 max_context=40")


def test_slow_step_logged_with_phases(caplog):
    trace = StepTrace(threshold_ms=20)
    with caplog.at_level(logging.INFO, logger="loomserve.engine.steps"):
        _step(trace, 0.0)
        _step(trace, 0.03)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert "execute=" in lines[0] and "seqs=2 new_tokens=3" in lines[0]
    ms = float(lines[0].split("execute=")[1].split()[0])
    assert ms >= 25


def test_gap_between_steps_logged(caplog):
    trace = StepTrace(threshold_ms=20)
    with caplog.at_level(logging.INFO, logger="loomserve.engine.steps"):
        _step(trace, 0.0)
        time.sleep(0.03)  # the core loop's own work between two steps
        _step(trace, 0.0)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "gap before" in lines[0]
    assert float(lines[0].split("gap before ")[1].split()[0]) >= 25


def test_off_by_default(monkeypatch, caplog):
    monkeypatch.delenv("LOOMSERVE_SLOW_STEP_MS", raising=False)
    trace = StepTrace()
    assert not trace.enabled
    with caplog.at_level(logging.INFO, logger="loomserve.engine.steps"):
        _step(trace, 0.03)
    assert not caplog.records


def test_env_turns_it_on(monkeypatch):
    monkeypatch.setenv("LOOMSERVE_SLOW_STEP_MS", "150")
    assert StepTrace().threshold_s == 0.15


def test_gap_across_idle_not_logged(caplog):
    trace = StepTrace(threshold_ms=20)
    with caplog.at_level(logging.INFO, logger="loomserve.engine.steps"):
        _step(trace, 0.0)
        trace.idle()  # the loop waited for work: not the loop's own time
        time.sleep(0.03)
        _step(trace, 0.0)
    assert not caplog.records
