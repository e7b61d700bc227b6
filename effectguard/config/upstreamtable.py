"""``[upstream]``: how the proxy's upstream leg waits and how many connections it holds.

Read from the config file's table into one value; ``load_settings`` spreads it over the
leg's settings and the guard's (which bounds a whole answer: ``read_timeout_s`` a plain
answer's body, ``stream_timeout_s`` an event stream).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from effectguard.config import defaults, values
from effectguard.errors import ConfigError


@dataclass(frozen=True, slots=True)
class UpstreamTable:
    """The ``[upstream]`` table, checked."""

    connect_timeout_s: float
    read_timeout_s: float
    #: 0: a stream may run as long as its upstream keeps sending.
    stream_timeout_s: float
    connections: int
    connections_per_origin: int


def upstream_table(upstream: Mapping[str, Any]) -> UpstreamTable:
    """``[upstream]``'s values (defaults for the keys it lacks); a refused one raises
    ``ConfigError`` naming the key."""
    d = defaults
    total, per_origin = _pool(upstream)
    return UpstreamTable(
        connect_timeout_s=values.positive(
            upstream, "connect_timeout_s", d.CONNECT_TIMEOUT_S, "upstream"
        ),
        read_timeout_s=values.positive(upstream, "read_timeout_s", d.READ_TIMEOUT_S, "upstream"),
        stream_timeout_s=values.number(
            upstream, "stream_timeout_s", d.STREAM_TIMEOUT_S, "upstream"
        ),
        connections=total,
        connections_per_origin=per_origin,
    )


def _pool(upstream: Mapping[str, Any]) -> tuple[int, int]:
    """``[upstream]`` max_connections, and max_connections_per_upstream: half of it unless
    set, so that one upstream holding its connections unanswered (up to ``read_timeout_s``
    each) leaves the other half to every other provider."""
    total = values.whole(
        upstream, "max_connections", defaults.UPSTREAM_CONNECTIONS, "upstream", above_zero=True
    )
    per_origin = values.whole(
        upstream, "max_connections_per_upstream", max(1, total // 2), "upstream", above_zero=True
    )
    if per_origin > total:
        raise ConfigError(
            f"upstream.max_connections_per_upstream: must be at most upstream.max_connections "
            f"({total}), which bounds all upstreams together"
        )
    return total, per_origin
