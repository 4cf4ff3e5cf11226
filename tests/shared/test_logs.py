"""Log lines stay small whatever a caller sent: long strings, long lists, long tracebacks are cut."""

from __future__ import annotations

import json
import logging
import sys

import pytest

from kv_manager_service.shared.logs import (
    MAX_LOGGED_IDS,
    MAX_LOGGED_MESSAGE_CHARS,
    MAX_LOGGED_TRACEBACK_CHARS,
    MAX_LOGGED_VALUE_CHARS,
    JsonFormatter,
    TextFormatter,
    shorten,
)


def hostile_record() -> logging.LogRecord:
    """A rejected call's line, as a 2 MiB id would make it: in the message, in a list field, in a traceback."""
    huge = "x" * (2 << 20)
    record = logging.LogRecord("kv", logging.INFO, __file__, 1, "Free rejected: unknown request id %r", (huge,), None)
    record.request_ids = [huge] * 1000
    record.worker_id = huge
    record.field = "request_ids"
    try:
        raise KeyError(huge)
    except KeyError:
        record.exc_info = sys.exc_info()
    return record


@pytest.mark.parametrize("formatter", [JsonFormatter(), TextFormatter()], ids=["json", "text"])
def test_a_line_is_small_whatever_the_caller_sent(formatter: logging.Formatter):
    line = formatter.format(hostile_record())
    budget = MAX_LOGGED_MESSAGE_CHARS + (MAX_LOGGED_IDS + 1) * MAX_LOGGED_VALUE_CHARS + MAX_LOGGED_TRACEBACK_CHARS
    assert len(line) < budget + 4096
    assert "characters cut" in line and "968 more" in line
    assert "request_ids" in line and "KeyError" in line  # the field and the exception's type survive


def test_json_lines_keep_their_fields_and_stay_json():
    entry = json.loads(JsonFormatter().format(hostile_record()))
    assert entry["field"] == "request_ids"
    assert len(entry["request_ids"]) == MAX_LOGGED_IDS + 1 and entry["request_ids"][-1] == "...968 more"
    assert all(len(value) < MAX_LOGGED_VALUE_CHARS + 64 for value in entry["request_ids"])
    assert entry["msg"].startswith("Free rejected: unknown request id 'xxx") and entry["msg"].endswith("xxx'")
    assert len(entry["exc"]) < MAX_LOGGED_TRACEBACK_CHARS + 64 and entry["exc"].startswith("Traceback")


def test_shorten_keeps_short_text_and_the_head_and_tail_of_long_text():
    assert shorten("abc", 3) == "abc"
    assert shorten("a" * 10 + "b" * 10, 10) == "aaaaa...[10 characters cut]...bbbbb"
