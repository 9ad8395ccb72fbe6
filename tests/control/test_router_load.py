"""The router's sustained-load average (instances.LoadAverage) against a closed form."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from loomserve.control.router.instances import Instance, Lease, LoadAverage


def test_a_held_level_approaches_it_and_a_burst_barely_counts():
    now = [0.0]
    avg = LoadAverage(30.0, clock=lambda: now[0])
    avg.set(100.0)
    now[0] = 3.0  # a 3 s burst: 1 - e^-0.1 of the level
    assert math.isclose(avg.average(), 100.0 * (1 - math.exp(-0.1)))
    avg.set(0.0)
    now[0] = 33.0  # and 30 s of nothing after it
    assert math.isclose(avg.average(), 100.0 * (1 - math.exp(-0.1)) * math.exp(-1.0))
    avg.set(50.0)
    now[0] = 10_000.0
    assert math.isclose(avg.average(), 50.0)


@given(st.lists(st.tuples(st.floats(0, 60), st.floats(0, 1000)), min_size=1, max_size=30))
def test_average_is_the_exponentially_weighted_integral(steps):
    """Piecewise-constant input: the average equals the closed-form weighted integral and stays
    within the range of the levels held."""
    now = [0.0]
    tau = 30.0
    avg = LoadAverage(tau, clock=lambda: now[0])
    levels = []  # (start, end, value)
    for dt, value in steps:
        avg.set(value)
        levels.append((now[0], now[0] + dt, value))
        now[0] += dt
    t = now[0]
    expect = sum(v * (math.exp((b - t) / tau) - math.exp((a - t) / tau)) for a, b, v in levels)
    assert math.isclose(avg.average(), expect, rel_tol=1e-9, abs_tol=1e-6)
    assert avg.average() <= max(v for _, _, v in levels) + 1e-9


def test_leases_drive_the_instance_load():
    now = [0.0]
    inst = Instance("http://a:1")
    inst.load = LoadAverage(30.0, clock=lambda: now[0])
    lease = Lease(inst, 64, 16)
    assert inst.active_blocks == 4.0
    now[0] = 30.0
    lease.release()
    assert inst.active_blocks == 0.0
    assert math.isclose(inst.load.average(), 4.0 * (1 - math.exp(-1.0)))


def test_metrics_show_the_averaged_load():
    from types import SimpleNamespace

    from loomserve.control.router.kv_index import KVIndex
    from loomserve.control.router.metrics import RouterMetrics

    now = [0.0]
    inst = Instance("http://a:1")
    inst.load = LoadAverage(30.0, clock=lambda: now[0])
    inst.active_blocks = 10.0
    now[0] = 30.0
    m = RouterMetrics()
    m.refresh(SimpleNamespace(instances=[inst]), KVIndex(), SimpleNamespace(sessions=lambda: 0))
    text = m.render()[0].decode()
    avg = 10.0 * (1 - math.exp(-1.0))
    assert f'loomserve_router_active_blocks_avg{{instance="a:1"}} {avg}' in text
