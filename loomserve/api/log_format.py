"""Log output for `loomserve serve` and `loomserve router`: `--log-format text` (the default,
one human line per record) or `json` (one JSON object per line, for log shippers).

A JSON line holds timestamp (UTC, ISO 8601), level, logger and message, then every field a
record carries beyond the standard ones: a request log line (metrics.RequestTimer) adds
request_id, session_id, finish_reason, prompt_tokens, cached_tokens, output_tokens,
latency_s and ttft_s. An exception adds its traceback as `exc_info`. The engine core's
lines follow the same format, with `component` "core" (config.log_lines).
"""

from __future__ import annotations

import logging

from loomserve.config.log_lines import TEXT_FORMAT, JSONFormatter, choose_format


def configure_logging(level: str, fmt: str = "text") -> None:
    """The root logger's level and format, also for the processes spawned from here (the
    engine core: config.log_lines); uvicorn's loggers go through the root in json (its
    access lines become JSON records too)."""
    choose_format(fmt)
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
