"""Log lines: one line per record, logfmt or JSON, every value escaped.

Values that come from the wire (paths, model names, engine error messages, request ids)
end up in log messages and fields. A raw CR or LF in one of them would let a client
forge a log line, so every record is rendered here: logfmt quotes any value that is not
a plain token (JSON string escaping), and JSON lines are ``json.dumps`` of the record.
Records may carry structured fields in ``extra={"fields": {...}}`` (the per-request line
of proxy.measure.recorder does).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

_PLAIN = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:/+@")


def logfmt_value(value: object) -> str:
    """A logfmt value: bare when it is a plain token, else a JSON string (escaped)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    text = str(value)
    if text and all(c in _PLAIN for c in text):
        return text
    return json.dumps(text)


def _timestamp(record: logging.LogRecord) -> str:
    t = time.gmtime(record.created)
    return time.strftime("%Y-%m-%dT%H:%M:%S", t) + f".{int(record.msecs):03d}Z"


class LogfmtFormatter(logging.Formatter):
    """``ts=… level=… logger=… msg=… key=value …`` on one line."""

    def __init__(self, tag: dict[str, object] | None = None) -> None:
        super().__init__()
        self.tag = tag or {}

    def format(self, record: logging.LogRecord) -> str:
        parts = [
            f"ts={_timestamp(record)}",
            f"level={record.levelname.lower()}",
            f"logger={logfmt_value(record.name)}",
        ]
        parts += [f"{k}={logfmt_value(v)}" for k, v in self.tag.items()]
        parts.append(f"msg={logfmt_value(record.getMessage())}")
        for k, v in (getattr(record, "fields", None) or {}).items():
            parts.append(f"{k}={logfmt_value(v)}")
        if record.exc_info:
            parts.append(f"exc={logfmt_value(self.formatException(record.exc_info))}")
        return " ".join(parts)


class JsonFormatter(logging.Formatter):
    """One JSON object per line."""

    def __init__(self, tag: dict[str, object] | None = None) -> None:
        super().__init__()
        self.tag = tag or {}

    def format(self, record: logging.LogRecord) -> str:
        obj: dict[str, object] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            **self.tag,
            "msg": record.getMessage(),
        }
        obj.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        # ASCII only: U+2028, U+0085 and their kind end a line for many log readers
        return json.dumps(obj, ensure_ascii=True, default=str)


def configure_logging(level: str, log_format: str = "logfmt", worker: int | None = None) -> None:
    """Send every record to stderr as one escaped line. ``log_format``: logfmt, json, or
    none (logfmt, without the per-request lines: the recorder is told separately)."""
    tag: dict[str, object] = {} if worker is None else {"worker": worker, "pid": os.getpid()}
    formatter: logging.Formatter = (
        JsonFormatter(tag) if log_format == "json" else LogfmtFormatter(tag)
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    # one line per upstream call is noise; their warnings still show
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
