"""Process logs on stderr: one JSON object per line (the default), or plain text.

A JSON line always has `ts` (ISO 8601, UTC, milliseconds), `level`,
`logger` and `msg` (the formatted message), then every field passed with
`extra={...}` (`request_ids`, `step_id`, `worker_id`, `code`, `field`, ...),
and `exc` with the formatted traceback when the record carries an exception.
Values JSON cannot hold are written as their `str`; non-ASCII characters
are escaped, so a line stays valid whatever the stream's encoding. The text
format prints the same extra fields as `key=value` after the message.

A line stays small whatever a caller sent: the message is cut to
MAX_LOGGED_MESSAGE_CHARS, each string of an extra field to
MAX_LOGGED_VALUE_CHARS, each list to its first MAX_LOGGED_IDS entries, and
a traceback to MAX_LOGGED_TRACEBACK_CHARS; a cut keeps the head and the tail
and says how many characters it dropped.

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
MAX_LOGGED_MESSAGE_CHARS = 2048
MAX_LOGGED_VALUE_CHARS = 256  # one string of an extra field: a whole request id
MAX_LOGGED_TRACEBACK_CHARS = 16384

# Attributes every LogRecord has; anything else on a record came from `extra`.
_RECORD_ATTRIBUTES = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}
_CORE_FIELDS = ("ts", "level", "logger", "msg", "exc")


def extra_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The fields a caller attached with `extra={...}`, in the order given, each cut to size (`bounded`)."""
    return {
        key: bounded(value)
        for key, value in record.__dict__.items()
        if key not in _RECORD_ATTRIBUTES and key not in _CORE_FIELDS and not key.startswith("_")
    }


def shorten(text: str, max_chars: int) -> str:
    """`text`, or its head and tail with the number of characters cut between them (at most `max_chars` + ~40)."""
    if len(text) <= max_chars:
        return text
    head = max_chars // 2
    tail = max_chars - head
    return f"{text[:head]}...[{len(text) - max_chars} characters cut]...{text[len(text) - tail:]}"


def bounded(value: Any) -> Any:
    """A log field's value cut to size: strings shortened, lists cut to MAX_LOGGED_IDS entries (then a count
    of the rest), dicts likewise; numbers, booleans and None as they are, anything else as its shortened `str`."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, str):
        return shorten(value, MAX_LOGGED_VALUE_CHARS)
    if isinstance(value, (list, tuple, set, frozenset)):
        items = list(value)
        kept = [bounded(item) for item in items[:MAX_LOGGED_IDS]]
        return kept + [f"...{len(items) - MAX_LOGGED_IDS} more"] if len(items) > MAX_LOGGED_IDS else kept
    if isinstance(value, dict):
        kept = {str(key)[:MAX_LOGGED_VALUE_CHARS]: bounded(item) for key, item in list(value.items())[:MAX_LOGGED_IDS]}
        if len(value) > MAX_LOGGED_IDS:
            kept["..."] = f"{len(value) - MAX_LOGGED_IDS} more"
        return kept
    return shorten(str(value), MAX_LOGGED_VALUE_CHARS)


def message(record: logging.LogRecord) -> str:
    """The record's formatted message, shortened to MAX_LOGGED_MESSAGE_CHARS."""
    return shorten(record.getMessage(), MAX_LOGGED_MESSAGE_CHARS)


def exception_text(formatter: logging.Formatter, record: logging.LogRecord) -> str | None:
    """The record's traceback (or its cached text), shortened to MAX_LOGGED_TRACEBACK_CHARS; None if it has none."""
    if record.exc_info:
        return shorten(formatter.formatException(record.exc_info), MAX_LOGGED_TRACEBACK_CHARS)
    if record.exc_text:
        return shorten(record.exc_text, MAX_LOGGED_TRACEBACK_CHARS)
    return None


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
            "msg": message(record),
        }
        entry.update(extra_fields(record))
        exc = exception_text(self, record)
        if exc is not None:
            entry["exc"] = exc
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str)


class TextFormatter(logging.Formatter):
    """`ts LEVEL logger: message key=value ...`, then the traceback, if any, on the following lines."""

    def format(self, record: logging.LogRecord) -> str:
        line = f"{iso_utc(record.created)} {record.levelname} {record.name}: {message(record)}"
        exc = exception_text(self, record)
        if exc is not None:
            line = f"{line}\n{exc}"
        if record.stack_info:
            line = f"{line}\n{self.formatStack(record.stack_info)}"
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


class OutageLog:
    """A dependency that stops answering, logged as an operator wants it: one WARNING when it fails, then
    at most one every `every_s` while it stays down (with the count of failed calls), and one INFO when it
    answers again. Thread-safe: every caller of the dependency reports to the same one."""

    def __init__(self, logger: logging.Logger, what: str, while_down: str = "", every_s: float = 60.0) -> None:
        """`what`: the dependency, as a sentence's subject; `while_down`: what the process does meanwhile."""
        self.logger = logger
        self.what = what
        self.while_down = while_down
        self.every_s = every_s
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self._logged_at = 0.0
        self._failures = 0

    def failed(self, error: BaseException) -> None:
        now = time.monotonic()
        with self._lock:
            self._failures += 1
            if self._down_since is None:
                self._down_since = self._logged_at = now
                self.logger.warning("%s is unreachable (%s)%s", self.what, error,
                                    f"; {self.while_down}" if self.while_down else "")  # fmt: skip
            elif now - self._logged_at >= self.every_s:
                self._logged_at = now
                self.logger.warning("%s is still unreachable after %.0f s (%d failed calls; the last: %s)",
                                    self.what, now - self._down_since, self._failures, error)  # fmt: skip

    def succeeded(self) -> None:
        with self._lock:
            if self._down_since is None:
                return
            self.logger.info("%s answers again after %.1f s (%d failed calls)",
                             self.what, time.monotonic() - self._down_since, self._failures)  # fmt: skip
            self._down_since = None
            self._failures = 0
