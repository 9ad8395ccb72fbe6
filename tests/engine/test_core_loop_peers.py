"""CoreLoop's exit when a lockstep peer leaves first on a Shutdown (core_loop.CoreLoop.run): the
front end's Shutdown reaches the DP ranks at slightly different times, so a rank's all-reduce
can fail because its peer already left; with its own Shutdown arriving within the grace, that is
a clean stop (exit 0, no CoreDead), and anything else stays a failure (exit 1, CoreDead)."""

from __future__ import annotations

from types import SimpleNamespace

from loomserve.engine.core_loop import CoreLoop
from loomserve.engine.messages import CoreDead, Shutdown


class ScriptedTransport:
    def __init__(self, script: list[list]) -> None:
        self.script, self.sent = list(script), []

    def recv(self, timeout: float) -> list:
        return self.script.pop(0) if self.script else []

    def send(self, event) -> None:
        self.sent.append(event)


class CollectiveFails:
    """A core whose first step fails as an all-reduce does when a peer has left."""

    def __init__(self, grace: float | None) -> None:
        self.config = SimpleNamespace(scheduler=SimpleNamespace(stream_interval=1))
        if grace is not None:
            self.peer_grace_s = grace

    def has_work(self) -> bool:
        return True

    def step(self):
        raise RuntimeError("Connection closed by peer")


def test_a_peer_leaving_on_shutdown_is_a_clean_stop():
    t = ScriptedTransport([[], [], [Shutdown()]])
    assert CoreLoop(CollectiveFails(0.5), t).run() == 0
    assert not t.sent


def test_without_a_shutdown_the_failure_is_reported():
    t = ScriptedTransport([[]])
    assert CoreLoop(CollectiveFails(0.2), t).run() == 1
    assert [type(e) for e in t.sent] == [CoreDead]


def test_a_core_without_peers_reports_at_once():
    t = ScriptedTransport([[], [Shutdown()]])  # the Shutdown is never looked for
    assert CoreLoop(CollectiveFails(None), t).run() == 1
    assert [type(e) for e in t.sent] == [CoreDead]
