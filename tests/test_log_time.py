"""A log line's time is datetime's ISO 8601 text of the record's time, to the millisecond.

The formatters write the text up to the second once per second; the reference is the
plain datetime form every line had before, including its rounding (half-even to the
microsecond, carried into the next second).
"""

from __future__ import annotations

import datetime as dt
import json
import logging

from hypothesis import example, given, settings
from hypothesis import strategies as st

from effectguard.telemetry.logs import JsonFormatter, TextFormatter


def reference(created: float) -> str:
    moment = dt.datetime.fromtimestamp(created, tz=dt.UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _record(created: float) -> logging.LogRecord:
    record = logging.LogRecord("effectguard.access", logging.INFO, "", 0, "m", (), None)
    record.created = created
    return record


TIMES = (
    st.floats(min_value=0, max_value=253402300799.99, allow_nan=False)
    | st.integers(min_value=0, max_value=2**33).map(lambda s: s + 0.9999995)
    | st.integers(min_value=0, max_value=2**33).map(lambda s: s + 0.0005)
    | st.floats(min_value=1.7e9, max_value=1.9e9)
)


@settings(max_examples=1500)
@given(st.lists(TIMES, min_size=1, max_size=5))
@example([1796121469.9999995, 1796121469.4251792, 1796121470.0])
@example([0.0, 1e-7, 0.9999996, 253402300799.9994])
@example([1796121469.0005, 1796121469.0015, 1796121469.0025])
def test_line_times_are_datetimes_text(times: list[float]) -> None:
    """The same text as datetime for any time, in any order (the cache is by second)."""
    for created in times + times[::-1]:
        line = TextFormatter().format(_record(created))
        assert line.split(" ", 1)[0] == reference(created)
        assert json.loads(JsonFormatter().format(_record(created)))["time"] == reference(created)
