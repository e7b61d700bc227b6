"""Logs that tell an operator what happened: one access line per request, one line per
incident, as text or as JSON lines (``serve --log-format text|json --log-level LEVEL``).

* :class:`LogObserver` is the guard's :class:`~effectguard.telemetry.observer.Observer`
  for logs: it writes the access line (logger ``effectguard.access``) when a request's
  outcome is known, and incidents — failed observations, interrupts — to
  ``effectguard.events``. Other layers log their incidents (sweeps, takeovers,
  reconciliations) with the standard :mod:`logging` calls, naming the call in
  ``extra={"call_id": ...}``; the formatters here render any such field.
* :func:`configure_logging` installs one handler on the root logger, with
  :class:`JsonFormatter` or :class:`TextFormatter`.

What a line may hold is chosen field by field from a :class:`CallReport`, which holds no
body and no credential, so nothing secret can reach a log by accident.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
import sys
import threading
import time
from typing import IO, Any

from effectguard.config.settings import LOG_FORMATS
from effectguard.rules import notes
from effectguard.rules.money import nanos_to_usd
from effectguard.telemetry.logwriter import QueuedStreamHandler
from effectguard.telemetry.observer import NullObserver
from effectguard.telemetry.report import CallReport

__all__ = [
    "JsonFormatter",
    "LogObserver",
    "TextFormatter",
    "access_fields",
    "configure_logging",
]

ACCESS = logging.getLogger("effectguard.access")
EVENTS = logging.getLogger("effectguard.events")
THREADS = logging.getLogger("effectguard.threads")

#: The source file a record names when logging does not look its caller up.
_NO_SOURCE = "(unknown file)"
#: Attributes every LogRecord has; anything else on a record came from ``extra``.
_STANDARD = frozenset(
    logging.LogRecord("", 0, "", 0, "", None, None).__dict__.keys() | {"message", "asctime"}
)


def _iso(created: float) -> str:
    """A record's time as ISO 8601 UTC with milliseconds."""
    # Every access line pays for this: the text up to the second is made once per
    # second. The split into second and microsecond is datetime.fromtimestamp's own
    # (half-even rounding of the fraction, carried into the second).
    global _last_second
    if not 0 <= created < _LAST_SECOND_SHOWN:  # before 1970 or beyond year 9999: datetime's
        moment = dt.datetime.fromtimestamp(created, tz=dt.UTC)
        return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")
    fraction, whole = math.modf(created)
    micros = round(fraction * 1e6)
    second = int(whole) + (micros >= 1_000_000)
    cached, prefix = _last_second
    if cached != second:
        prefix = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        _last_second = (second, prefix)
    return f"{prefix}.{micros % 1_000_000 // 1000:03d}Z"


#: The last second :func:`_iso` wrote, and its text up to the second (read as one tuple).
_last_second: tuple[int, str] = (-1, "")
#: 10000-01-01T00:00:00Z: later times are written by datetime (which refuses them).
_LAST_SECOND_SHOWN = 253402300800


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in record.__dict__.items() if k not in _STANDARD}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and every ``extra`` field."""

    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, Any] = {
            "time": _iso(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        payload.update(_extras(record))
        if record.exc_info:
            payload["exception"] = self.formatException(record.exc_info)
        if record.stack_info:  # logged with stack_info=True: who logged it
            payload["stack"] = self.formatStack(record.stack_info)
        line = json.dumps(payload, default=str, ensure_ascii=False)
        # json escapes only C0 controls; a client's C1 control (U+009B, a terminal's CSI),
        # line separator or direction override would reach `tail -f` and line splitters
        # raw. Such a line is written all in ASCII escapes instead, still the same JSON.
        return line if line.isprintable() else json.dumps(payload, default=str)


class TextFormatter(logging.Formatter):
    """``TIME LEVEL LOGGER: message key=value …`` — for a person reading a terminal."""

    def format(self, record: logging.LogRecord) -> str:
        # One pass over the record (every access line comes here): no dict of extras.
        fields = " ".join(
            [
                f"{k}={_text(v)}"
                for k, v in record.__dict__.items()
                if v is not None and k not in _STANDARD
            ]
        )
        # A message may quote what a client or an upstream sent (a path, an error's text):
        # escaped, a line break or a terminal escape in it cannot forge or hide a line.
        message = notes.terminal_safe(record.getMessage(), keep="")
        line = f"{_iso(record.created)} {record.levelname} {record.name}: {message}"
        if fields:
            line = f"{line} {fields}"
        if record.exc_info:
            # The JSON line's ``exception``, JSON-quoted: its line breaks stay escapes,
            # so the traceback is a field of this record and never lines of its own.
            line = f"{line} exception={_text(self.formatException(record.exc_info))}"
        if record.stack_info:  # quoted as the traceback is: its line breaks stay escapes
            line = f"{line} stack={_text(self.formatStack(record.stack_info))}"
        return line


def _text(value: Any) -> str:
    text = value if type(value) is str else str(value)
    # Quoted as JSON (ASCII escapes) when it would not read as one bare word: a space, a
    # quote, or a character that is not printable (a line break, a terminal escape).
    quoted = " " in text or '"' in text or not text or not text.isprintable()
    return json.dumps(text) if quoted else text


def configure_logging(
    log_format: str = "text", level: str = "info", stream: IO[str] | None = None
) -> logging.Handler:
    """Send every log record to ``stream`` (stderr, through a writer thread) in
    ``log_format``; effectguard's own loggers at ``level``, other libraries' at warning
    and above.

    Other libraries stay at warning because some log request URLs at info level, and a
    URL may carry a credential in its query string.
    """
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}")
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    # The process's stderr may be a pipe whose reader stalls: its lines are written by a
    # thread (logwriter), never by the event loop. A stream given here is written at once.
    handler: logging.Handler = (
        QueuedStreamHandler(sys.stderr) if stream is None else logging.StreamHandler(stream)
    )
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
        if isinstance(old, QueuedStreamHandler):
            old.flush()  # its lines written, then its thread ended
            old.close()
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    # A library's warnings.warn (a hook's, a driver's) would be written raw by Python,
    # lines of text among JSON lines: as records of ``py.warnings`` each is one line.
    logging.captureWarnings(True)
    threading.excepthook = _log_thread_death  # likewise a thread's uncaught traceback
    logging.getLogger("effectguard").setLevel(numeric)
    return handler


def _log_thread_death(args: threading.ExceptHookArgs) -> None:
    """A thread that died of an exception: one error record, its traceback the field
    ``exception``, where Python would write the traceback raw to stderr."""
    if args.exc_type is SystemExit:  # a thread's sys.exit(): not an error (as Python's)
        return
    name = args.thread.name if args.thread is not None else "?"
    exc_info = (args.exc_type, args.exc_value or args.exc_type(), args.exc_traceback)
    THREADS.error("thread %s died: %s", name, args.exc_type.__name__, exc_info=exc_info)


#: Characters of a detail (an exception's text, a refusal's message) a line may carry.
MAX_DETAIL = 300


def _short(text: str) -> str:
    """``text`` cut to :data:`MAX_DETAIL` characters: one line stays one readable line."""
    return text if len(text) <= MAX_DETAIL else text[: MAX_DETAIL - 1] + "…"


def _seconds(value: float) -> float:
    return round(value, 6)


def access_fields(report: CallReport) -> dict[str, Any]:
    """The access line's fields (a report's outcome; never a body or a credential)."""
    # call_id and cost_usd are absent, not null, where there is none (logs-and-traces.md):
    # a request that never became a call, a call nothing was settled for.
    fields: dict[str, Any] = {"event": "access"}
    if report.call_id is not None:
        fields["call_id"] = report.call_id  # first: what a reader of the line looks for
    fields |= {
        "provider": report.provider,
        "method": report.method,
        # The client chose these (a refused budget or model is logged as sent): a line stays short.
        "endpoint": _short(report.endpoint),
        "model": _short(report.model) or None,
        "budget": _short(report.budget),
        "status": report.status,
        "stage": report.stage or None,
        "outcome": report.outcome or None,
        "attempts": report.attempts,
        "input_tokens": report.input_tokens,
        "output_tokens": report.output_tokens,
        "upstream_s": _seconds(report.upstream_s),
        "overhead_s": _seconds(report.overhead_s),
    }
    if report.cost_nanos is not None:
        fields["cost_usd"] = nanos_to_usd(report.cost_nanos)
    if report.error is not None:
        fields["error"] = report.error
    if report.key is not None:  # who spent: absent where no proxy keys are configured
        fields["key"] = report.key
    return fields


#: Outcomes an operator must see whatever status the line shows: a client that left
#: first makes a 504 ``effect_unknown`` a 499, a broken stream's line says the 200 it had.
WARNING_OUTCOMES: frozenset[str] = frozenset(
    {"effect_unknown", "observe_failed", "fenced", "error"}
)


def access_level(report: CallReport) -> int:
    """An access line's level: warning for a 5xx, or an outcome worse than its status."""
    if report.status >= 500 or report.outcome in WARNING_OUTCOMES:
        return logging.WARNING
    return logging.INFO


class LogObserver(NullObserver):
    """Writes the access line of every request and one line per incident."""

    def __init__(self, access: logging.Logger = ACCESS, events: logging.Logger = EVENTS) -> None:
        self.access = access
        self.events = events

    def call_finished(self, report: CallReport) -> None:
        # A refusal at 5xx is an operator's business (the ledger, the upstream, a fault of
        # ours), so its access line is a warning that carries the refusal's message.
        serious = report.status >= 500
        level = access_level(report)
        if not self.access.isEnabledFor(level):
            return
        fields = access_fields(report)
        if serious and report.message:
            fields["detail"] = _short(report.message)
        # The path is written as a field's value is: a client's path with (encoded) spaces
        # would otherwise add words like ``call_id=...`` to a text line, read as fields.
        path = _text(f"/{report.provider}{fields['endpoint']}")
        summary = f"{report.method} {path} {report.status}"
        # Logger.log less its caller lookup (a walk of the stack per line): the record is
        # the one logging makes when it does not look callers up (logging._srcfile None).
        access = self.access
        access.handle(
            access.makeRecord(access.name, level, _NO_SOURCE, 0, summary, (), None, None, fields)
        )

    def incident(self, kind: str, call_id: str | None, detail: str) -> None:
        detail = _short(detail)
        # The detail may quote an upstream (a broken status line, an error's text): in the
        # message it is one quoted word, as in its field, or its words could read as fields.
        self.events.warning(
            "%s: call %s: %s",
            kind,
            call_id or "-",
            _text(detail),
            extra={"event": kind, "call_id": call_id, "detail": detail},
        )
