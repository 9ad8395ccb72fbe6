"""Log output for `loomserve serve` and `loomserve router`: `--log-format text` (the default,
one human line per record) or `json` (one JSON object per line, for log shippers).

A JSON line holds timestamp (UTC, ISO 8601), level, logger and message, then every field a
record carries beyond the standard ones: a request log line (metrics.RequestTimer) adds
request_id, session_id, finish_reason, prompt_tokens, cached_tokens, output_tokens,
latency_s and ttft_s. An exception adds its traceback as `exc_info`.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# LogRecord's own attributes: anything else on a record came in through `extra`.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message", "asctime", "taskName"}


class JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"timestamp": datetime.fromtimestamp(record.created, timezone.utc)
               .isoformat(timespec="milliseconds"),
               "level": record.levelname, "logger": record.name,
               "message": record.getMessage()}
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in out:
                out[key] = value
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure_logging(level: str, fmt: str = "text") -> None:
    """The root logger's level and format; uvicorn's loggers go through the root in json
    (its access lines become JSON records too)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JSONFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    if fmt == "json":
        for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
            logging.getLogger(name).handlers[:] = []
            logging.getLogger(name).propagate = True


def uvicorn_log_config(fmt: str) -> dict | None:
    """uvicorn.Config's log_config: None in json (keep the root's handler), else uvicorn's."""
    if fmt == "json":
        return None
    from uvicorn.config import LOGGING_CONFIG
    return LOGGING_CONFIG
