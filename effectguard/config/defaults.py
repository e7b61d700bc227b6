"""The one set of defaults. Every other place that needs one names it from here."""

from __future__ import annotations

from collections.abc import Mapping

#: The embedded ledger, relative to the working directory (docs/configuration.md).
LEDGER = "effectguard.db"
#: The environment variable that names the ledger when no flag or config file does.
LEDGER_ENV = "EFFECTGUARD_LEDGER"

HOST = "127.0.0.1"
PORT = 8787
MAX_BODY_BYTES = 10 * 1024 * 1024
#: A billable answer larger than this is not read further: the call is effect unknown.
#: Above the largest real answers of the declared endpoints (ten base64 images, about
#: 40 MB), and it keeps one misbehaving upstream from exhausting the proxy's memory.
MAX_ANSWER_BYTES = 64 * 1024 * 1024
#: A multipart body larger than this is spooled to a file (ingress/spool.py).
SPOOL_BODY_BYTES = 1024 * 1024
DRAIN_TIMEOUT_S = 30.0
CONNECT_TIMEOUT_S = 10.0

# The front door (docs/configuration.md, [server]): what one client connection may take.
#: From a connection's first byte (or a kept-alive connection's next request) to its
#: last header line; a slow sender is cut off with 408 after this.
HEADER_TIMEOUT_S = 10.0
#: From the end of the headers to the last byte of the body.
BODY_TIMEOUT_S = 120.0
#: How long a client may stop reading an answer (its socket's buffers full) before it
#: is cut off; the call is then read to its end and settled without it.
SEND_TIMEOUT_S = 60.0
#: Request line plus headers; larger ones get 431.
MAX_HEADER_BYTES = 64 * 1024
#: Open connections (and requests) at once; beyond it new requests get 503.
MAX_CONNECTIONS = 1024
#: How long an idle kept-alive connection stays open.
KEEP_ALIVE_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 600.0
#: The whole of an event stream, from its headers to its end (0: no bound). Generous: a
#: long generation streams for minutes; a stream trickled without end must still stop.
STREAM_TIMEOUT_S = 3600.0
#: The upstream leg's connections in use at once, all upstreams together (as many as the
#: old httpx limits allowed). A request past it waits, unsent, up to ``connect_timeout_s``.
UPSTREAM_CONNECTIONS = 1000
#: How long the upstream legs (the proxy's and the transports' own pools) keep an idle
#: connection for reuse: under the most common upstream keep-alive timeout, 5 s (uvicorn,
#: so vLLM; Node; Apache). At 5 s, as both legs had it, a call sent just before the
#: upstream's close crossed it on the wire, was lost unread and booked effect_unknown.
UPSTREAM_KEEPALIVE_S = 4.0
#: How often each replica re-reads the ledger's proxy keys: a key created or revoked
#: anywhere is honoured by every replica within about this long.
KEY_REFRESH_S = 2.0
#: How long one read of the proxy keys may take before the replica gives it up (a hung
#: ledger connection); a copy older than ``key_refresh_s`` plus this no longer vouches
#: for a ledger key, which is then refused 503 until a read succeeds.
KEY_READ_WAIT_S = 5.0

# The operator page (docs/operations.md): where it lives and how long a login lasts.
#: Every page and form of the operator page is under this path; nothing else is.
ADMIN_PREFIX = "/_effectguard/"
#: A login session's lifetime; after it the browser must log in with the key again.
ADMIN_SESSION_S = 8 * 3600.0
#: Mixed into the page's session signing secret when set (the same on every replica).
ADMIN_SECRET_ENV = "EFFECTGUARD_ADMIN_SECRET"

# Operators' view (docs/configuration.md, [server]): logs and traces.
#: ``text`` for a terminal, ``json`` for one JSON object per line (log shippers).
LOG_FORMAT = "text"
#: effectguard's own loggers; access lines are ``info``, incidents ``warning``.
LOG_LEVEL = "info"
#: One OpenTelemetry span per call (needs the ``effectguard[otel]`` extra).
OTEL = False

# A worker's lease, its heartbeat and the recovery sweep (docs/contract.md §7).
LEASE_S = 15.0
HEARTBEAT_S = 3.0
SWEEP_S = 5.0


def ledger_from(environ: Mapping[str, str]) -> str:
    """The ledger named by the environment, else the default."""
    return environ.get(LEDGER_ENV) or LEDGER
