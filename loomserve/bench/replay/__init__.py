"""`loomserve bench agentx`: closed-loop replay of agentic traces against an OpenAI-compatible
endpoint (see shared AGENTX.md for the rules).

    transport.py  the HTTP client (streaming completions, JSON calls) behind `Transport`
    timing.py     the clock and the pacer (send timers, pull-in when idle)
    driver.py     the session driver (`Replayer`: slots, session trees, one request)
    probe.py      what the endpoint accepts (model, vocabulary, ids or text prompts)
    scrape.py     the served hit split by source from /metrics
    cli.py        options, `run_replay`, `main`

The HTTP layer sits behind `Transport` and time behind `Clock`, so tests run the whole replay
on a fake clock against an in-process fake server. Every public name is importable from here.
"""

from loomserve.bench.replay.cli import add_arguments, main, run_replay
from loomserve.bench.replay.driver import Replayer
from loomserve.bench.replay.probe import ServerInfo, probe_server
from loomserve.bench.replay.scrape import (
    HIT_SOURCE_METRIC,
    counter_delta,
    parse_hit_tokens_by_source,
    scrape_hit_tokens_by_source,
)
from loomserve.bench.replay.timing import Clock, Pacer, RealClock
from loomserve.bench.replay.transport import HttpxTransport, Transport, TransportError

__all__ = ["Clock", "RealClock", "Transport", "TransportError", "HttpxTransport", "Pacer",
           "Replayer", "ServerInfo", "probe_server", "add_arguments", "main", "run_replay",
           "parse_hit_tokens_by_source", "scrape_hit_tokens_by_source", "counter_delta",
           "HIT_SOURCE_METRIC"]
