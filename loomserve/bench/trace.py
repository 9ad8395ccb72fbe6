"""Weka-format agentic traces: one JSON object per session (see AGENTX.md).

CONTRACT (the trace helper implements the parsing; replay and simulator code against this):

    TraceRequest: one model call.
        t: float            start time in seconds from the SESSION start (subagent times are
                            normalized to session time whatever convention the file used)
        in_tokens: int      input tokens ("in")
        out_tokens: int     output tokens ("out")
        hash_ids: tuple[int, ...]  one id per block_size-token block of the input, chained
        think_time: float   client-side gap before the request ("think_time", 0 if absent)
        api_time: float | None     original server time ("api_time"; None if absent)
        streaming: bool     type == "s"
        stop: str | None
        agent: str          "main" or the subagent's agent_id
    Subagent: a child agent's run, started after the parent turn before it.
        agent_id, subagent_type: str; t: float (session time); duration_ms: float | None
        requests: list[TraceRequest]  (time order)
    SubagentGroup: consecutive subagent entries between two parent turns (they run at once).
        subagents: list[Subagent]; after_index: int  (index into Session.main of the parent
        turn they follow; -1 if before the first); joined: bool (True when the next parent turn
        waits for the group: the group finished before that turn started in the recording)
    Session:
        id: str; path: str; block_size: int; models: list[str]
        main: list[TraceRequest]            the parent agent's requests, time order
        groups: list[SubagentGroup]         in order
        all_requests() -> list[TraceRequest]  main + subagents, sorted by t

    load_trace(path) -> Session        raises TraceError (names the file and the field/line)
    load_traces(paths) -> list[Session]  files and directories (*.json, sorted); all or nothing
    class TraceError(ValueError)
"""

# Parsing rules (beyond the contract above):
#
# * Validation: every request needs `t` (number >= 0), `in`/`out` (integers >= 0; integral
#   floats are accepted), `hash_ids` (list of integers, any sign), `type` ("n", "s" or
#   "subagent"). `think_time` and `api_time` are optional numbers >= 0. A subagent entry needs
#   `t`, a non-empty `requests` list, a string `agent_id` unique in the session (not "main");
#   `subagent_type` defaults to "", `duration_ms` is an optional number >= 0. Subagents nested
#   inside subagents are rejected (no corpus has them; the data model has no place for them).
# * Block count: `len(hash_ids)` must lie between floor(in / block_size) and
#   ceil(in / block_size). The shipped Weka traces hash full blocks only (floor, 2107 of 2156
#   requests have a partial last block without an id); other writers hash the partial last
#   block too (ceil). Anything else is a TraceError.
# * Subagent times: per file, if any subagent's first request starts more than
#   SUBAGENT_T_TOLERANCE seconds before the subagent's own `t`, the file uses times relative to
#   the subagent (as the Weka corpus does, restarting at 0) and every subagent request gets the
#   subagent's `t` added; otherwise child times are taken as session-absolute. (A child cannot
#   start before its subagent in session time; the tolerance absorbs the whole-second rounding
#   of request times against the millisecond subagent `t`.) When no subagent decides it, the
#   two readings differ by less than the tolerance.
# * Order: the top-level `requests` list must be in time order for the main agent (t
#   non-decreasing, tolerance 1 s for rounding); subagent requests likewise within a subagent.
#   A group is a maximal run of consecutive subagent entries in that list.
# * joined: group end = max over its subagents of `t + duration_ms / 1000` (or, without
#   duration_ms, the last request's t + api_time). The group is joined when a next parent turn
#   exists and group end <= that turn's t. A trailing group (no parent turn after it) is
#   never joined: nothing waits for it; the replay decides when the session slot is free.

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "TraceRequest", "Subagent", "SubagentGroup", "Session", "TraceError",
    "load_trace", "load_traces", "parse_session", "SUBAGENT_T_TOLERANCE",
]

SUBAGENT_T_TOLERANCE = 1.0  # seconds
_ORDER_TOLERANCE = 1.0  # seconds


class TraceError(ValueError):
    """A trace file that cannot be used; the message names the file and the field or line."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    t: float
    in_tokens: int
    out_tokens: int
    hash_ids: tuple[int, ...]
    think_time: float = 0.0
    api_time: float | None = None
    streaming: bool = False
    stop: str | None = None
    agent: str = "main"


@dataclass(frozen=True, slots=True)
class Subagent:
    agent_id: str
    subagent_type: str
    t: float
    duration_ms: float | None
    requests: list[TraceRequest]

    @property
    def end(self) -> float:
        """Session time at which the subagent finished in the recording."""
        if self.duration_ms is not None:
            return self.t + self.duration_ms / 1000.0
        last = self.requests[-1]
        return max(self.t, last.t + (last.api_time or 0.0))


@dataclass(frozen=True, slots=True)
class SubagentGroup:
    subagents: list[Subagent]
    after_index: int
    joined: bool

    @property
    def t(self) -> float:
        return min(s.t for s in self.subagents)

    @property
    def end(self) -> float:
        return max(s.end for s in self.subagents)


@dataclass(frozen=True, slots=True)
class Session:
    id: str
    path: str
    block_size: int
    models: list[str]
    main: list[TraceRequest]
    groups: list[SubagentGroup]

    def all_requests(self) -> list[TraceRequest]:
        """Main and subagent requests sorted by t (stable: main first, then groups in order)."""
        reqs = list(self.main)
        for g in self.groups:
            for s in g.subagents:
                reqs.extend(s.requests)
        reqs.sort(key=lambda r: r.t)
        return reqs

    def subagents(self) -> list[Subagent]:
        return [s for g in self.groups for s in g.subagents]


# ---------------------------------------------------------------------------------------------
# parsing

class _Bad(Exception):
    def __init__(self, where: str, msg: str):
        super().__init__(where, msg)
        self.where = where
        self.msg = msg


def _num(obj: dict, key: str, where: str, *, required: bool = True, default=None) -> float | None:
    if key not in obj or obj[key] is None:
        if required:
            raise _Bad(f"{where}.{key}", "missing")
        return default
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _Bad(f"{where}.{key}", f"expected a number, got {type(v).__name__} {v!r:.40}")
    if not math.isfinite(v) or v < 0:
        raise _Bad(f"{where}.{key}", f"must be a finite number >= 0, got {v!r}")
    return float(v)


def _int(obj: dict, key: str, where: str) -> int:
    if key not in obj:
        raise _Bad(f"{where}.{key}", "missing")
    v = obj[key]
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise _Bad(f"{where}.{key}", f"expected an integer, got {type(v).__name__} {v!r:.40}")
    if v < 0:
        raise _Bad(f"{where}.{key}", f"must be >= 0, got {v}")
    return v


def _str(obj: dict, key: str, where: str, *, required: bool = True, default=None) -> str | None:
    if key not in obj or obj[key] is None:
        if required:
            raise _Bad(f"{where}.{key}", "missing")
        return default
    v = obj[key]
    if not isinstance(v, str):
        raise _Bad(f"{where}.{key}", f"expected a string, got {type(v).__name__}")
    return v


def _request(r, where: str, block_size: int, agent: str, t_offset: float) -> TraceRequest:
    typ = _str(r, "type", where)
    if typ not in ("n", "s"):
        raise _Bad(f"{where}.type", f"expected 'n', 's' or 'subagent', got {typ!r}")
    t = _num(r, "t", where)
    n_in = _int(r, "in", where)
    n_out = _int(r, "out", where)
    ids = r.get("hash_ids")
    if ids is None:
        raise _Bad(f"{where}.hash_ids", "missing")
    if not isinstance(ids, list):
        raise _Bad(f"{where}.hash_ids", f"expected a list of integers, got {type(ids).__name__}")
    if not set(map(type, ids)) <= {int}:
        bad = next(i for i, x in enumerate(ids) if type(x) is not int)
        raise _Bad(f"{where}.hash_ids[{bad}]", f"expected an integer, got {ids[bad]!r:.40}")
    lo, hi = n_in // block_size, -(-n_in // block_size)
    if not lo <= len(ids) <= hi:
        want = str(lo) if lo == hi else f"{lo} or {hi}"
        raise _Bad(f"{where}.hash_ids",
                   f"has {len(ids)} ids; in={n_in} with block_size={block_size} needs {want}")
    stop = r.get("stop")
    if stop is not None and not isinstance(stop, str):
        raise _Bad(f"{where}.stop", f"expected a string, got {type(stop).__name__}")
    return TraceRequest(
        t=t + t_offset, in_tokens=n_in, out_tokens=n_out, hash_ids=tuple(ids),
        think_time=_num(r, "think_time", where, required=False, default=0.0),
        api_time=_num(r, "api_time", where, required=False),
        streaming=typ == "s", stop=stop, agent=agent)


def _check_order(reqs: list[TraceRequest], where: str, index_of) -> None:
    for k in range(1, len(reqs)):
        if reqs[k].t + _ORDER_TOLERANCE < reqs[k - 1].t:
            raise _Bad(f"{where}[{index_of(k)}].t",
                       f"{reqs[k].t} is before the previous request's {reqs[k - 1].t}")


def parse_session(doc, path: str = "<memory>") -> Session:
    """Build a Session from a decoded Weka-format object; raises TraceError."""
    try:
        return _parse(doc, str(path))
    except _Bad as e:
        raise TraceError(f"{path}: {e.where}: {e.msg}") from None


def _parse(doc, path: str) -> Session:
    if not isinstance(doc, dict):
        raise _Bad("<root>", f"expected a JSON object, got {type(doc).__name__}")
    sid = doc.get("id")
    if sid is None:
        sid = Path(path).stem
    elif not isinstance(sid, (str, int)):
        raise _Bad("id", "expected a string")
    block_size = _int(doc, "block_size", "<root>") if "block_size" in doc else 64
    if block_size <= 0:
        raise _Bad("block_size", "must be > 0")
    models = doc.get("models", [])
    if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
        raise _Bad("models", "expected a list of strings")
    entries = doc.get("requests")
    if entries is None:
        raise _Bad("requests", "missing")
    if not isinstance(entries, list):
        raise _Bad("requests", "expected a list")

    # Decide the subagent time convention for the whole file first.
    relative = False
    for i, e in enumerate(entries):
        if isinstance(e, dict) and e.get("type") == "subagent":
            st = _num(e, "t", f"requests[{i}]")
            kids = e.get("requests")
            if isinstance(kids, list) and kids and isinstance(kids[0], dict):
                kt = kids[0].get("t")
                if isinstance(kt, (int, float)) and not isinstance(kt, bool) \
                        and kt < st - SUBAGENT_T_TOLERANCE:
                    relative = True
                    break

    main: list[TraceRequest] = []
    main_index: list[int] = []  # position in `entries` of each main request
    groups: list[SubagentGroup] = []
    pending: list[Subagent] = []
    agent_ids: set[str] = set()

    def close_group():
        if pending:
            groups.append(SubagentGroup(subagents=list(pending), after_index=len(main) - 1,
                                        joined=False))
            pending.clear()

    for i, e in enumerate(entries):
        where = f"requests[{i}]"
        if not isinstance(e, dict):
            raise _Bad(where, f"expected an object, got {type(e).__name__}")
        typ = _str(e, "type", where)
        if typ != "subagent":
            close_group()
            main.append(_request(e, where, block_size, "main", 0.0))
            main_index.append(i)
            continue
        st = _num(e, "t", where)
        aid = e.get("agent_id")
        if not isinstance(aid, str) or not aid:
            raise _Bad(f"{where}.agent_id", "missing" if aid is None else "expected a non-empty string")
        if aid == "main" or aid in agent_ids:
            raise _Bad(f"{where}.agent_id", f"{aid!r} is not unique in the session")
        agent_ids.add(aid)
        stype = _str(e, "subagent_type", where, required=False, default="")
        dur = _num(e, "duration_ms", where, required=False)
        kids = e.get("requests")
        if kids is None:
            raise _Bad(f"{where}.requests", "missing")
        if not isinstance(kids, list) or not kids:
            raise _Bad(f"{where}.requests", "expected a non-empty list")
        reqs = []
        for j, k in enumerate(kids):
            kw = f"{where}.requests[{j}]"
            if not isinstance(k, dict):
                raise _Bad(kw, f"expected an object, got {type(k).__name__}")
            if k.get("type") == "subagent":
                raise _Bad(f"{kw}.type", "nested subagents are not supported")
            reqs.append(_request(k, kw, block_size, aid, st if relative else 0.0))
        _check_order(reqs, f"{where}.requests", lambda k: k)
        pending.append(Subagent(agent_id=aid, subagent_type=stype, t=st, duration_ms=dur,
                                requests=reqs))
    close_group()
    _check_order(main, "requests", lambda k: main_index[k])

    # joined: the group finished before the next parent turn started.
    groups = [
        dataclasses.replace(g, joined=(g.after_index + 1 < len(main)
                                       and g.end <= main[g.after_index + 1].t))
        for g in groups
    ]
    return Session(id=str(sid), path=path, block_size=block_size, models=list(models),
                   main=main, groups=groups)


def load_trace(path) -> Session:
    """Load and validate one Weka-format trace file; raises TraceError naming the file."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise TraceError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        doc = json.loads(data)
    except json.JSONDecodeError as e:
        raise TraceError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    except UnicodeDecodeError as e:
        raise TraceError(f"{path}: not UTF-8 text: {e}") from None
    return parse_session(doc, path)


def trace_paths(paths) -> list[str]:
    """Expand files and directories (their *.json, sorted) into a list of files."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out: list[str] = []
    for p in paths:
        p = os.fspath(p)
        if os.path.isdir(p):
            found = sorted(str(q) for q in Path(p).glob("*.json") if q.is_file())
            if not found:
                raise TraceError(f"{p}: directory holds no *.json trace")
            out.extend(found)
        elif os.path.exists(p):
            out.append(p)
        else:
            raise TraceError(f"{p}: no such file or directory")
    return out


def load_traces(paths) -> list[Session]:
    """Load files and directories (*.json, sorted). All or nothing: any bad file raises."""
    return [load_trace(p) for p in trace_paths(paths)]
