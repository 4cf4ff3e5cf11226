"""Process logs on stderr: one JSON object per line (the default), or plain text.

A JSON line always has `ts` (ISO 8601, UTC, milliseconds), `level`,
`logger` and `msg` (the formatted message), then every field passed with
`extra={...}` (`request_ids`, `step_id`, `worker_id`, `code`, `field`, ...),
and `exc` with the formatted traceback when the record carries an exception.
Values JSON cannot hold are written as their `str`; non-ASCII characters
are escaped, so a line stays valid whatever the stream's encoding. The text
format prints the same extra fields as `key=value` after the message.

Both `kv-manager serve` and `gpu-worker` call `configure_logging` once, before
anything logs; uncaught exceptions (main thread or any other) are logged
through it too, so stderr stays one record per line.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from types import TracebackType
from typing import Any

LOG_FORMATS = ("json", "text")
MAX_LOGGED_IDS = 32  # ids listed in one log line; a call may carry thousands

# Attributes every LogRecord has; anything else on a record came from `extra`.
_RECORD_ATTRIBUTES = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}
_CORE_FIELDS = ("ts", "level", "logger", "msg", "exc")


def extra_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The fields a caller attached with `extra={...}`, in the order given."""
    return {
        key: value
        for key, value in record.__dict__.items()
        if key not in _RECORD_ATTRIBUTES and key not in _CORE_FIELDS and not key.startswith("_")
    }


def iso_utc(created: float) -> str:
    """`created` (seconds since the epoch) as `2025-01-31T12:00:00.123Z`."""
    seconds = int(created)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{int((created - seconds) * 1000):03d}Z"


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (newlines inside values are escaped)."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": iso_utc(record.created),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update(extra_fields(record))
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exc"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str)


class TextFormatter(logging.Formatter):
    """`ts LEVEL logger: message key=value ...`, then the traceback, if any, on the following lines."""

    def __init__(self) -> None:
        super().__init__("%(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = f"{iso_utc(record.created)} {super().format(record)}"
        fields = extra_fields(record)
        if not fields:
            return line
        head, newline, tail = line.partition("\n")  # keep key=value on the message's line
        pairs = " ".join(f"{key}={json.dumps(value, default=str)}" for key, value in fields.items())
        return f"{head} {pairs}{newline}{tail}"


def configure_logging(level: str, fmt: str = "json") -> None:
    """Send every log record of the process to stderr in `fmt` (`json` or `text`), from `level` up.

    Replaces the root logger's handlers, routes `warnings` through logging,
    and logs uncaught exceptions (as `exc`) instead of printing them raw.
    """
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    logging.captureWarnings(True)
    sys.excepthook = _log_uncaught
    threading.excepthook = _log_uncaught_in_thread


def _log_uncaught(kind: type[BaseException], error: BaseException, traceback: TracebackType | None) -> None:
    if issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, error, traceback)
        return
    logging.getLogger("uncaught").critical("uncaught %s: %s", kind.__name__, error, exc_info=(kind, error, traceback))


def _log_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return
    thread = args.thread.name if args.thread is not None else "?"
    logging.getLogger("uncaught").critical(
        "uncaught %s in thread %s: %s",
        args.exc_type.__name__,
        thread,
        args.exc_value,
        exc_info=(args.exc_type, args.exc_value, args.exc_traceback),
        extra={"thread_name": thread},
    )
