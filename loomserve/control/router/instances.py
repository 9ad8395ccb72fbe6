"""The instances behind a router: who they are (/info), whether they are up (health checks),
how loaded they are (the router's own accounting), and what they cache (their KV events).

Health: GET /health every `interval` seconds with a `timeout`; a refused connection marks an
instance down at once, any other failure (timeout, non-200) twice in a row does. So a dead
process is out at the next check (within `interval`, 0.5 s by default) and a hung one after
two timed-out checks (within 2 x (interval + timeout), 2 s by default). A down instance is probed on the same schedule and comes back on its first 200, after
its /info is read again (it may have restarted with other event endpoints).

Load: the router counts what it sent and has not seen finish: in-flight requests and their
blocks (the whole prompt plus the tokens generated so far, over block_size: what the request
holds in the instance's KV pool while it decodes). A `Lease` adds a request on creation and
takes exactly what it added away on release(). Beside the present blocks, each instance keeps
their time-weighted average over about the last LOAD_WINDOW_S seconds (`LoadAverage`), so a
policy can tell a sustained overload from a burst that drains by itself.

Invariants: an instance that is down holds nothing in the KV index (cleared when it goes
down, refilled only by events after it is up again); `went_down` is set exactly while the
instance is down, so a request in flight can wait on it instead of on a dead socket.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

from loomserve.control.router.kv_index import KVIndex

logger = logging.getLogger("loomserve.control.router")

WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]", "")
LOAD_WINDOW_S = 30.0


class LoadAverage:
    """The time-weighted exponential average of a piecewise-constant load (`value`), with time
    constant `tau` s: a level held for tau counts 63%, a burst of tau/10 under 10%.
    Invariant: `avg` is the average up to time `t`; between set() calls the load was `value`."""

    def __init__(self, tau: float = LOAD_WINDOW_S, clock=time.monotonic) -> None:
        self.tau, self.clock = tau, clock
        self.value = self.avg = 0.0
        self.t = clock()

    def set(self, value: float) -> None:
        self._advance()
        self.value = value

    def average(self) -> float:
        self._advance()
        return self.avg

    def _advance(self) -> None:
        now = self.clock()
        if now > self.t:
            self.avg = self.value + (self.avg - self.value) * math.exp((self.t - now) / self.tau)
            self.t = now


@dataclass(eq=False)
class Instance:
    url: str  # base URL, no trailing slash
    info: dict | None = None  # its GET /info, None until first read
    up: bool = False
    fails: int = 0
    active_requests: int = 0
    load: LoadAverage = field(default_factory=LoadAverage)  # active blocks, now and averaged
    subscriber: object | None = None
    went_down: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        self.went_down.set()  # down until a health check says otherwise

    @property
    def active_blocks(self) -> float:
        return self.load.value

    @active_blocks.setter
    def active_blocks(self, blocks: float) -> None:
        self.load.set(blocks)

    @property
    def name(self) -> str:
        """The label in metrics and headers: host:port."""
        return urlsplit(self.url).netloc

    @property
    def role(self) -> str:
        return (self.info or {}).get("role", "both")

    @property
    def block_size(self) -> int | None:
        return (self.info or {}).get("block_size")


class Lease:
    """One request's share of an instance's load (see the module doc)."""

    def __init__(self, inst: Instance, prompt_tokens: int, block_size: int) -> None:
        self.inst = inst
        self.block_size = max(block_size, 1)
        self.blocks = prompt_tokens / self.block_size
        self.released = False
        inst.active_requests += 1
        inst.active_blocks += self.blocks

    def on_tokens(self, n: int) -> None:
        if not self.released and n:
            grow = n / self.block_size
            self.blocks += grow
            self.inst.active_blocks += grow

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.inst.active_requests -= 1
            self.inst.active_blocks = max(0.0, self.inst.active_blocks - self.blocks)


def events_address(endpoint: str | None, url: str) -> str | None:
    """A bound ZMQ address with a wildcard host made reachable: the host of `url`."""
    if not endpoint or not endpoint.startswith("tcp://"):
        return endpoint
    host, _, port = endpoint[6:].rpartition(":")
    if host in WILDCARD_HOSTS:
        host = urlsplit(url).hostname or "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
    return f"tcp://{host}:{port}"


class InstanceSet:
    def __init__(self, urls: list[str], index: KVIndex, *, api_key: str | None = None,
                 interval: float = 0.5, timeout: float = 0.5, fail_threshold: int = 2,
                 events: bool = True) -> None:
        if not urls:
            raise ValueError("a router needs at least one --instance URL")
        self.instances = [Instance(u) for u in urls]
        self.index = index
        self.interval, self.timeout, self.fail_threshold = interval, timeout, fail_threshold
        self.events = events
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.on_change: list[Callable[[Instance], None]] = []  # called on up/down transitions
        self._client: httpx.AsyncClient | None = None
        self._task: asyncio.Task | None = None

    def healthy(self) -> list[Instance]:
        return [i for i in self.instances if i.up]

    def by_name(self, name: str) -> Instance | None:
        return next((i for i in self.instances if i.name == name), None)

    async def start(self) -> None:
        """Probe every instance once (so a router that starts after them routes at once),
        then keep probing in the background."""
        self._client = httpx.AsyncClient(timeout=self.timeout, headers=self.headers)
        await asyncio.gather(*(self.probe(i) for i in self.instances))
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for inst in self.instances:
            self._stop_events(inst)
        if self._client is not None:
            await self._client.aclose()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await asyncio.gather(*(self.probe(i) for i in self.instances))

    async def probe(self, inst: Instance) -> None:
        """One health check; moves the instance up or down (see the module doc)."""
        try:
            r = await self._client.get(inst.url + "/health")
            ok = r.status_code == 200
            if ok and not inst.up:
                info = await self._client.get(inst.url + "/info")
                info.raise_for_status()
                self._bring_up(inst, info.json())
        except httpx.ConnectError:
            self.mark_down(inst, "connection refused")
            return
        except (httpx.HTTPError, ValueError) as e:
            ok = False
            logger.debug("health check of %s failed: %s", inst.name, e)
        if ok:
            inst.fails = 0
            return
        inst.fails += 1
        if inst.fails >= self.fail_threshold:
            self.mark_down(inst, f"{inst.fails} failed health checks")

    def mark_down(self, inst: Instance, why: str) -> None:
        """Take an instance out: no new requests, its cached blocks forgotten, in-flight
        requests to it woken (they fail fast instead of waiting on a dead peer)."""
        if not inst.up:
            return
        logger.warning("instance %s is down: %s", inst.name, why)
        inst.up = False
        inst.went_down.set()
        self._stop_events(inst)
        self.index.clear(inst.name)
        for cb in self.on_change:
            cb(inst)

    def _bring_up(self, inst: Instance, info: dict) -> None:
        inst.info, inst.fails = info, 0
        inst.up = True
        inst.went_down = asyncio.Event()
        self.index.clear(inst.name)  # whatever it held before is unknown now
        if self.events:
            self._start_events(inst)
        logger.info("instance %s is up (role %s)", inst.name, inst.role)
        sizes = {i.block_size for i in self.instances if i.block_size}
        if len(sizes) > 1:
            logger.warning("instances disagree on the block size (%s): KV-aware routing uses "
                           "%d and misses on the others", sorted(sizes), min(sizes))
        for cb in self.on_change:
            cb(inst)

    def _start_events(self, inst: Instance) -> None:
        ev = (inst.info or {}).get("kv_events")
        if not ev or not ev.get("endpoint"):
            return
        try:
            from loomserve.control.kv_events import KVEventSubscriber
        except ImportError:
            logger.warning("no KV event subscriber in this build: %s routes without its "
                           "cache contents", inst.name)
            return
        name, index = inst.name, self.index

        def on_batch(batch) -> None:
            if inst.up:  # a batch racing mark_down must not refill a down instance's entries
                index.apply(name, batch)

        sub = KVEventSubscriber(
            events_address(ev["endpoint"], inst.url),
            events_address(ev.get("replay_endpoint"), inst.url), on_batch=on_batch,
            on_reset=lambda: self.index.clear(name), topic=ev.get("topic") or "", name=name)
        sub.start()
        inst.subscriber = sub

    def _stop_events(self, inst: Instance) -> None:
        sub, inst.subscriber = inst.subscriber, None
        if sub is not None:  # close() joins its thread (~1 s): not on the event loop
            threading.Thread(target=sub.close, name=f"close-{inst.name}", daemon=True).start()

    def block_size(self) -> int:
        """The instances' block size (they must agree: the hashes are per block)."""
        sizes = {i.block_size for i in self.instances if i.block_size}
        return min(sizes) if sizes else 16

    def events_stats(self) -> dict[str, dict]:
        return {i.name: i.subscriber.stats() for i in self.instances
                if i.subscriber is not None}
