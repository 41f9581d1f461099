"""The server's log: stdlib logging to stderr, one line per event, as text or JSON.

`grctl serve --log-level LEVEL --log-format text|json` (GR_LOG_LEVEL, GR_LOG_FORMAT) calls
`configure` once; every logger of the process (grctl's, uvicorn's) then writes through one
handler. Events carry named fields, so both formats read the same facts:

    2026-11-30 15:50:01,123 INFO grctl.server: weight_update transport=tensor tensors=6 ...
    {"ts": "2026-11-30T15:50:01.123Z", "level": "INFO", "logger": "grctl.server",
     "event": "weight_update", "transport": "tensor", "tensors": 6, "bytes": 49152, ...}

Events: weight_update (transport, tensors, bytes, ms, version), weight_version, pause, continue,
refused (every error reply: code, status, method, path, client, message), auth_failure (the
same fields; never the key that was sent), request (with --log-requests, on the grctl.access
logger: method, path, route, status, ms, client).
"""

from __future__ import annotations

import json
import logging
import sys
import time

log = logging.getLogger("grctl.server")


def event(
    name: str, level: int = logging.INFO, logger: logging.Logger = log, **fields: object
) -> None:
    """Log one event: `name` is the message, `fields` its facts (JSON-friendly values)."""
    logger.log(level, name, extra={"event": name, "fields": fields})


def _text_value(value: object) -> str:
    text = str(value)
    return json.dumps(text) if not text or any(c in text for c in ' ="\n') else text


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        line = super().formatMessage(record)
        fields = getattr(record, "fields", None)
        if fields:
            line += " " + " ".join(f"{k}={_text_value(v)}" for k, v in fields.items())
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        doc: dict = {
            "ts": f"{ts}.{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
        }
        name = getattr(record, "event", None)
        if name is not None:
            doc["event"] = name
            doc.update(getattr(record, "fields", {}))
        else:
            doc["message"] = record.getMessage()
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def configure(level: str = "info", fmt: str = "text") -> None:
    """One stderr handler on the root logger, in `fmt`; grctl and uvicorn log at `level`."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    numeric = getattr(logging, level.upper())
    root.setLevel(numeric)
    for name in ("grctl", "uvicorn", "uvicorn.error"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.setLevel(numeric)
        logger.propagate = True
    # httpx logs every request at INFO: the router checks (server/router.py) would add a line
    # every few seconds; they show at --log-level debug
    logging.getLogger("httpx").setLevel(numeric if numeric <= logging.DEBUG else logging.WARNING)
