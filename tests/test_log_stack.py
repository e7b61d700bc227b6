"""A record logged with ``stack_info=True`` keeps its stack, on its one line.

``serve`` itself logs no such record, but a library or a hook running inside it may
(``logging.warning(..., stack_info=True)``); its stack is the record's only clue to who
logged it. Checked with the handler ``serve --log-format text|json`` installs
(:func:`configure_logging`): the text line carries it JSON-quoted as ``stack=``, as
``exception=`` carries a traceback, and the JSON line as the field ``stack``.
"""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Iterator

import pytest

from effectguard.telemetry.logs import configure_logging

RECORD = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z WARNING effectguard\.hook: ")


@pytest.fixture
def logged() -> Iterator[io.StringIO]:
    """Root logging as ``configure_logging`` leaves it, restored afterwards."""
    root = logging.getLogger()
    kept = (list(root.handlers), root.level, logging.getLogger("effectguard").level)
    yield io.StringIO()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in kept[0]:
        root.addHandler(handler)
    root.setLevel(kept[1])
    logging.getLogger("effectguard").setLevel(kept[2])


def a_hook_that_logs_its_stack() -> None:
    """Logs a warning with its caller's stack, as a library inside ``serve`` may."""
    logging.getLogger("effectguard.hook").warning("odd state", stack_info=True)


def a_hook_that_logs_both() -> None:
    """Logs a caught exception's traceback and its own stack on one record."""
    try:
        raise RuntimeError("a bug")
    except RuntimeError:
        logging.getLogger("effectguard.hook").warning("both", exc_info=True, stack_info=True)


def test_a_text_line_keeps_the_stack_as_a_quoted_field(logged: io.StringIO) -> None:
    """``--log-format text``: the stack is the field ``stack``, JSON-quoted on the line."""
    configure_logging("text", "info", stream=logged)
    a_hook_that_logs_its_stack()
    (line,) = logged.getvalue().splitlines()
    assert RECORD.match(line), line
    found = re.search(r' stack=("(?:[^"\\]|\\.)*")$', line)
    assert found, line
    stack = json.loads(found.group(1))
    assert stack.startswith("Stack (most recent call last):\n")
    assert "a_hook_that_logs_its_stack" in stack


def test_a_json_line_keeps_the_stack_as_a_field(logged: io.StringIO) -> None:
    """``--log-format json``: the stack is the string field ``stack`` of the one object."""
    configure_logging("json", "info", stream=logged)
    a_hook_that_logs_its_stack()
    (line,) = logged.getvalue().splitlines()
    record = json.loads(line)
    assert record["message"] == "odd state"
    assert record["stack"].startswith("Stack (most recent call last):\n")
    assert "a_hook_that_logs_its_stack" in record["stack"]


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_a_traceback_and_a_stack_are_two_fields_of_one_line(
    logged: io.StringIO, log_format: str
) -> None:
    """A record with both keeps both, each in its own field, still one line."""
    configure_logging(log_format, "info", stream=logged)
    a_hook_that_logs_both()
    (line,) = logged.getvalue().splitlines()
    if log_format == "json":
        record = json.loads(line)
        exception, stack = record["exception"], record["stack"]
    else:
        fields = re.findall(r' (exception|stack)=("(?:[^"\\]|\\.)*")', line)
        assert [name for name, _ in fields] == ["exception", "stack"], line
        exception, stack = (json.loads(value) for _, value in fields)
    assert "RuntimeError: a bug" in exception and "Stack (most" not in exception
    assert "a_hook_that_logs_both" in stack and "RuntimeError" not in stack
