"""The router's decisions, apart from HTTP: the session of a request, the instance it goes to
(through the policy), and whether its prompt is prefilled elsewhere first.

Sessions are read as the instances read them (loomserve.api.handler.session_of):
the X-Session-ID header, else the API body's field (prompt_cache_key for Chat Completions,
Completions and Responses, metadata.user_id for Messages), else a client's own session header
(Claude Code's X-Claude-Code-Session-Id, Codex's session_id). A subagent names its parent in
X-Parent-Session-ID.

A Responses turn that continues a stored response (previous_response_id) must go where that
response is stored: the router remembers which instance produced each response id it relayed
(`remember_response`) and sends the continuation there whatever the policy, while it is up.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict

from loomserve.control.router.instances import Instance, InstanceSet
from loomserve.control.router.kv_index import KVIndex
from loomserve.control.router.metrics import RouterMetrics
from loomserve.control.router.miss_causes import RouteView, view_of
from loomserve.control.router.pd import (
    client_candidates,
    prefill_candidates,
    should_disaggregate,
    uncached_tokens,
)
from loomserve.control.router.policies import Decision, KVAware, Policy, RouteRequest
from loomserve.control.router.tokens import API_MESSAGES, API_RESPONSES, PromptKeys

logger = logging.getLogger("loomserve.control.router")
MAX_REMEMBERED_RESPONSES = 100_000
# The instances' order (loomserve.api.handler, which this package may not import:
# it pulls in the engine client).
SESSION_HEADERS = ("x-session-id",)
FALLBACK_SESSION_HEADERS = ("x-claude-code-session-id", "session_id", "session-id")


class NoInstance(Exception):
    """No healthy instance can take the request (a 503)."""


def session_of(api: str, body: dict, headers) -> str | None:
    for name in SESSION_HEADERS:
        if value := headers.get(name):
            return value
    if api == API_MESSAGES:
        meta = body.get("metadata")
        field = meta.get("user_id") if isinstance(meta, dict) else None
    else:
        field = body.get("prompt_cache_key")
    if isinstance(field, str) and field:
        return field
    for name in FALLBACK_SESSION_HEADERS:
        if value := headers.get(name):
            return value
    return None


class Router:
    def __init__(self, instances: InstanceSet, index: KVIndex, policy: Policy,
                 metrics: RouterMetrics, *, tokenizer: str | None = None,
                 chat_template: str | None = None, pd_threshold_tokens: int = 2048) -> None:
        self.instances = instances
        self.index = index
        self.policy = policy
        self.metrics = metrics
        self.tokenizer_path = tokenizer
        self.chat_template = chat_template  # the template's text (the instances' override)
        self.pd_threshold = pd_threshold_tokens
        self.keys: PromptKeys | None = None
        self.tokenizer_settled = False  # loaded, or failed for good: /health waits for it
        self._prefill_policy = KVAware(index, instances.block_size)
        self._responses: OrderedDict[str, str] = OrderedDict()  # response id -> instance name

    async def load_tokenizer(self) -> None:
        """Load the tokenizer (--tokenizer, else the first instance's model folder) once an
        instance has answered /info; until then policies route without prompt knowledge."""
        while True:
            path = self.tokenizer_path or next(
                (i.info["model_folder"] for i in self.instances.instances
                 if i.info and i.info.get("model_folder")), None)
            if path:
                break
            await asyncio.sleep(0.2)
        from loomserve.execution.models.loading.hub import tokenizer_folder
        try:  # a hub id (or another host's snapshot path): its tokenizer files, fetched here
            folder = await asyncio.to_thread(tokenizer_folder, path)
            self.keys = await asyncio.to_thread(PromptKeys.from_folder, folder,
                                                self.instances.block_size(), self.chat_template)
            logger.info("router tokenizer: %s", path)
        except Exception:
            logger.exception("could not load the tokenizer from %s: routing without prompt "
                             "knowledge (round robin / least loaded fallbacks)", path)
        finally:
            self.tokenizer_settled = True

    def request(self, api: str, body: dict, headers) -> RouteRequest:
        session = session_of(api, body, headers)
        parent = headers.get("x-parent-session-id")
        keys = self.keys
        keys_fn = (lambda: keys.keys(api, body, session, parent)) if keys is not None else None
        return RouteRequest(api, session, parent, keys_fn)

    async def prepare(self, req: RouteRequest) -> None:
        """Tokenize and hash the prompt in a worker thread when the decision will need it
        (a cold prompt takes milliseconds: the event loop keeps relaying streams meanwhile)."""
        if req.keys_fn is None:
            return
        if self.policy.needs_keys(req) or prefill_candidates(self.instances.healthy()):
            await asyncio.to_thread(req.keys)

    def decide(self, req: RouteRequest, body: dict,
               exclude: tuple[Instance, ...] = ()) -> Decision:
        """The instance for a client's request (or its decode leg). NoInstance if none."""
        t0 = time.perf_counter()
        candidates = [i for i in client_candidates(self.instances.healthy())
                      if i not in exclude]
        if not candidates:
            raise NoInstance("no healthy instance can serve this request")
        d = self._continuation(req, body, candidates) or self.policy.choose(req, candidates)
        self.metrics.decision.observe(time.perf_counter() - t0)
        self.metrics.requests.labels(d.instance.name, d.reason).inc()
        if d.overlap is not None:
            self.metrics.overlap.labels(d.instance.name).observe(d.overlap)
        return d

    def prefill_target(self, req: RouteRequest, decision: Decision) -> Instance | None:
        """A prefill instance when this request should be disaggregated, else None."""
        prefills = prefill_candidates(self.instances.healthy())
        if not prefills:
            return None
        uncached = uncached_tokens(req, decision, self.index, self.instances.block_size())
        if not should_disaggregate(uncached, self.pd_threshold):
            self.metrics.pd.labels("local").inc()
            return None
        return self._prefill_policy.choose(req, prefills).instance

    def miss_view(self, req: RouteRequest, decision: Decision) -> RouteView | None:
        """The KV index's view at this decision, for the router's miss causes, when the prompt
        was hashed for it; None otherwise (nothing is hashed just for this)."""
        if req.known_tokens is None:
            return None
        moved = decision.moved_from
        return view_of(self.index, req.keys()[1], decision.instance.name,
                       moved.name if moved is not None else None)

    def leg_view(self, req: RouteRequest, inst: Instance) -> RouteView | None:
        """As miss_view, for a prefill leg sent to `inst`."""
        if req.known_tokens is None:
            return None
        return view_of(self.index, req.keys()[1], inst.name, None)

    def remember_response(self, response_id: str, inst: Instance) -> None:
        self._responses[response_id] = inst.name
        self._responses.move_to_end(response_id)
        if len(self._responses) > MAX_REMEMBERED_RESPONSES:
            self._responses.popitem(last=False)

    def response_home(self, response_id: str) -> Instance | None:
        """The instance that produced (and stores) a response this router relayed."""
        name = self._responses.get(response_id)
        return self.instances.by_name(name) if name else None

    def forget_session(self, session: str) -> str | None:
        """Drop the session's home and prompt memo; returns the instance name it had."""
        home = getattr(self.policy, "sticky", {}).get(session)
        self.policy.forget(session)
        if self.keys is not None:
            self.keys.forget(session)
        return home

    def _continuation(self, req: RouteRequest, body: dict,
                      candidates: list[Instance]) -> Decision | None:
        if req.api != API_RESPONSES or not isinstance(body.get("previous_response_id"), str):
            return None
        name = self._responses.get(body["previous_response_id"])
        inst = next((i for i in candidates if i.name == name), None)
        return Decision(inst, "stickiness") if inst is not None else None
