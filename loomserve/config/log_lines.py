"""Log lines as text or JSON, for every process of an instance: the front end
(api.log_format) and the processes it spawns (the engine core, tensor-parallel workers).

A JSON line holds timestamp (UTC, ISO 8601), level, logger and message, then every field a
record carries beyond the standard ones (a request log line's request_id, tokens, ...), then
the spawned process's `component` ("core", "core dp1", "rank 1"). An exception adds its
traceback as `exc_info`.

The format reaches spawned processes through the environment: the front end's choice (or a
headless DP node's --log-format) is set in LOOMSERVE_LOG_FORMAT (choose_format), which a
child inherits however it is started (multiprocessing, a worker's subprocess).
"""

from __future__ import annotations

import json
import logging
import os
from datetime import datetime, timezone

LOG_FORMATS = ("text", "json")
LOG_FORMAT_ENV = "LOOMSERVE_LOG_FORMAT"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# LogRecord's own attributes: anything else on a record came in through `extra`.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message", "asctime", "taskName"}


class JSONFormatter(logging.Formatter):
    """One JSON object per record; `fields` (e.g. the component) are added to each."""

    def __init__(self, fields: dict | None = None) -> None:
        super().__init__()
        self.fields = dict(fields or {})

    def format(self, record: logging.LogRecord) -> str:
        out = {"timestamp": datetime.fromtimestamp(record.created, timezone.utc)
               .isoformat(timespec="milliseconds"),
               "level": record.levelname, "logger": record.name,
               "message": record.getMessage()}
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in out:
                out[key] = value
        for key, value in self.fields.items():
            out.setdefault(key, value)
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def choose_format(fmt: str) -> None:
    """This process's log format, inherited by the processes it spawns from now on."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format {fmt!r}: one of {', '.join(LOG_FORMATS)}")
    os.environ[LOG_FORMAT_ENV] = fmt


def configure_child(level: str, component: str) -> None:
    """A spawned process's root logger: the inherited format (text by default), its lines
    labelled with `component`."""
    handler = logging.StreamHandler()
    if os.environ.get(LOG_FORMAT_ENV) == "json":
        handler.setFormatter(JSONFormatter({"component": component}))
    else:
        handler.setFormatter(logging.Formatter(
            f"%(asctime)s %(levelname)s %(name)s[{component}]: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
