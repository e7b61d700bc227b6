"""Typed settings for ``effectguard serve``, read once at the edge.

Sources, later ones winning: defaults, the ``--config`` TOML file, flags. The
environment is read here only (provider keys by the names declarations give).

Config file reference (every table optional)::

    ledger = "effectguard.db"   # or postgresql://...; CLI commands find it with --config

    [server]
    host = "127.0.0.1"
    port = 8787
    max_body_bytes = 10485760   # larger bodies get 413 before being read
    spool_body_bytes = 1048576  # a multipart upload larger than this goes to a file
    spool_dir = "/var/tmp"      # where (default: the system's temporary directory)
    drain_timeout_s = 30        # on SIGTERM: how long in-flight calls may finish; then
                                # each gets 504 effect_unknown and is marked so
    header_timeout_s = 10       # request line + headers must arrive within this (408)
    body_timeout_s = 120        # the body must arrive within this after the headers
    send_timeout_s = 60         # a client that stops reading its answer is cut off after this
    max_header_bytes = 65536    # request line + headers larger than this get 431
    max_connections = 1024      # connections/requests at once; beyond: 503
    keep_alive_timeout_s = 5    # an idle kept-alive connection is closed after this
    metrics_host = "127.0.0.1"  # with metrics_port: /metrics on its own listener only
    metrics_port = 9464
    provider_ports = { postmark = 8788 }  # a listener of its own for a provider: every
                                # path on it goes to that provider, no /postmark/ prefix
    key_refresh_s = 2           # each replica re-reads the ledger's keys this often
    log_format = "text"         # or "json": one JSON object per line (--log-format)
    log_level = "info"          # effectguard's loggers (--log-level); access lines are info
    otel = false                # one OpenTelemetry span per call (--otel; effectguard[otel])

    [guard]
    retry_window_s = 600        # key-less declared retries match calls this recent
    max_retries = 2             # automatic retries of provably-null attempts
    create_budgets = true       # false: an unknown budget path is refused (403)
    reconcile_hook = "app.hooks:did_it_happen"  # optional: the application answers
    reconcile_hook_timeout_s = 5                # past this, the hook's answer is unknown
    max_answer_bytes = 67108864 # a billable answer larger than this: effect unknown, 502

    [upstream]
    connect_timeout_s = 10
    read_timeout_s = 600        # each wait for the next bytes; a plain answer's whole body
    stream_timeout_s = 3600     # a whole event stream, from its headers (0: no bound)
    max_connections = 1000      # connections to upstreams in use at once, all together
    max_connections_per_upstream = 500  # to one upstream origin (default: half of the
                                # above), so one that never answers cannot take them all

    [budgets]                   # limits in USD (decimal strings); seeds only paths whose
    "team-a" = "50.00"          # limit no operator has set with `budget set` (that wins)

    [[keys]]                    # proxy keys; with any (here or in the ledger), every
    name = "team-a"             # request needs one. `effectguard key new` keeps keys in
    sha256 = "<hex digest of the key>"   # the ledger instead: no restart, no file edit
    budget_root = "team-a"
    metrics = false             # true: this key may read /metrics (needed once keys exist)

    [retention]                 # `effectguard archive` without --before archives final
    keep_bodies_days = 30       # calls resolved more than this many days ago

    [admin]                     # the operator page under /_effectguard/; off without keys
    session_hours = 8           # a login lasts this long
    [[admin.keys]]              # `effectguard key new --admin NAME` prints one
    name = "ana"                # recorded as `by` on every decision made with this key
    sha256 = "<hex digest of the admin key>"

The environment variable ``EFFECTGUARD_ADMIN_SECRET``, when set, is mixed into the
operator page's session signing secret (see :class:`AdminSettings`).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from effectguard.config import defaults, readkeys, values
from effectguard.config.keysettings import AdminKey as AdminKey
from effectguard.config.keysettings import AdminSettings as AdminSettings
from effectguard.config.keysettings import ProxyKey as ProxyKey
from effectguard.config.keysettings import admin_settings, proxy_keys
from effectguard.config.keysettings import hash_key as hash_key
from effectguard.config.upstreamtable import upstream_table
from effectguard.errors import ConfigError
from effectguard.providers import Provider, load_providers, upstream_argument
from effectguard.rules import budget as budgets
from effectguard.rules.money import typed_usd
from effectguard.rules.retention import RetentionPolicy
from effectguard.rules.urltext import redacted

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class GuardSettings:
    """How the guard behaves; read once at the edge."""

    retry_window_s: float = 600.0
    max_retries: int = 2
    retry_wait_s: float = 0.25
    retry_wait_max_s: float = 4.0
    create_budgets: bool = True
    join_timeout_s: float = 600.0
    join_poll_s: float = 0.05
    #: ``module:function`` of the application's reconcile hook (the proxy imports it).
    reconcile_hook: str | None = None
    #: How long the hook may take before its answer counts as unknown.
    reconcile_hook_timeout_s: float = 5.0
    #: A billable answer (body or event stream) is read to at most this many bytes; past
    #: it the attempt is interrupted (effect unknown), never held whole in memory.
    max_answer_bytes: int = defaults.MAX_ANSWER_BYTES
    #: The upstream read and write timeout (``[upstream] read_timeout_s``): each wait for
    #: the next bytes, and a plain answer's whole body from its headers. A transport
    #: caller's own httpx timeout bounds only its own wait.
    upstream_read_timeout_s: float = defaults.READ_TIMEOUT_S
    #: An event stream's whole answer, from its headers (``[upstream] stream_timeout_s``;
    #: 0: no bound): past it the stream is cut off as a read timeout is.
    upstream_stream_timeout_s: float = defaults.STREAM_TIMEOUT_S


@dataclass(frozen=True, slots=True)
class FrontDoor:
    """What one client connection may take (HTTP hygiene at the proxy's socket)."""

    header_timeout_s: float = defaults.HEADER_TIMEOUT_S
    body_timeout_s: float = defaults.BODY_TIMEOUT_S
    send_timeout_s: float = defaults.SEND_TIMEOUT_S
    max_header_bytes: int = defaults.MAX_HEADER_BYTES
    max_connections: int = defaults.MAX_CONNECTIONS
    keep_alive_timeout_s: float = defaults.KEEP_ALIVE_TIMEOUT_S


@dataclass(frozen=True)
class ServeSettings:
    """Everything ``effectguard serve`` needs."""

    ledger: str = defaults.LEDGER
    host: str = defaults.HOST
    port: int = defaults.PORT
    providers: Mapping[str, Provider] = field(default_factory=dict)
    provider_keys: Mapping[str, str] = field(default_factory=dict)
    guard: GuardSettings = field(default_factory=GuardSettings)
    budget_limits: Mapping[str, int] = field(default_factory=dict)
    keys: tuple[ProxyKey, ...] = ()
    admin: AdminSettings = field(default_factory=AdminSettings)
    max_body_bytes: int = defaults.MAX_BODY_BYTES
    spool_body_bytes: int = defaults.SPOOL_BODY_BYTES
    spool_dir: str | None = None
    drain_timeout_s: float = defaults.DRAIN_TIMEOUT_S
    front_door: FrontDoor = field(default_factory=lambda: FrontDoor())
    metrics_host: str = defaults.HOST
    metrics_port: int | None = None
    #: Provider name -> the port of a listener that routes every path to that provider.
    provider_ports: Mapping[str, int] = field(default_factory=dict)
    connect_timeout_s: float = defaults.CONNECT_TIMEOUT_S
    read_timeout_s: float = defaults.READ_TIMEOUT_S
    #: The upstream leg's connections in use at once: all upstreams together, and to any
    #: one upstream origin (scheme, host, port), which is what keeps a provider that never
    #: answers from holding every connection while calls to the others wait.
    upstream_connections: int = defaults.UPSTREAM_CONNECTIONS
    upstream_connections_per_origin: int = defaults.UPSTREAM_CONNECTIONS // 2
    lease_s: float = defaults.LEASE_S
    heartbeat_s: float = defaults.HEARTBEAT_S
    sweep_s: float = defaults.SWEEP_S
    key_refresh_s: float = defaults.KEY_REFRESH_S
    log_format: str = defaults.LOG_FORMAT
    log_level: str = defaults.LOG_LEVEL
    otel: bool = defaults.OTEL

    def __repr__(self) -> str:
        """Every field, but the ledger URL's password and the provider keys as ``***``: a
        repr ends up in logs, tracebacks and bug reports."""
        shown = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        shown["ledger"] = redacted(self.ledger)
        shown["provider_keys"] = {name: "***" for name in self.provider_keys}
        return f"ServeSettings({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

    def key_root(self, presented: str) -> ProxyKey | None:
        """The config-file proxy key matching ``presented``, if any."""
        digest = hash_key(presented)
        return next((k for k in self.keys if k.sha256 == digest), None)


def keys_from_environment(
    providers: Mapping[str, Provider], env: Mapping[str, str]
) -> dict[str, str]:
    """Each provider's API key, from the environment variable its declaration names.

    A key holding a character no header value may carry (a line break, as a secret read
    from a file often ends) is refused here, naming the variable and never the key:
    sent, it would fail every call after it was admitted, each one held as unknown."""
    keys = {
        name: env[p.api_key_env]
        for name, p in providers.items()
        if p.api_key_env and env.get(p.api_key_env)
    }
    for name, key in keys.items():
        if not key.isprintable():
            raise ConfigError(
                f"${providers[name].api_key_env} (the {name} API key) holds a control "
                "character, e.g. a trailing line break: no header can carry it"
            )
    return keys


def _table(raw: Mapping[str, Any], name: str, source: str) -> Mapping[str, Any]:
    value = raw.get(name, {})
    if not isinstance(value, Mapping):
        raise ConfigError(f"{source}: [{name}] must be a table")
    return value


def _front_door(server: Mapping[str, Any]) -> FrontDoor:
    d = defaults
    return FrontDoor(
        header_timeout_s=values.positive(server, "header_timeout_s", d.HEADER_TIMEOUT_S, "server"),
        body_timeout_s=values.positive(server, "body_timeout_s", d.BODY_TIMEOUT_S, "server"),
        send_timeout_s=values.positive(server, "send_timeout_s", d.SEND_TIMEOUT_S, "server"),
        max_header_bytes=values.whole(server, "max_header_bytes", d.MAX_HEADER_BYTES, "server"),
        max_connections=values.whole(server, "max_connections", d.MAX_CONNECTIONS, "server"),
        keep_alive_timeout_s=values.number(
            server, "keep_alive_timeout_s", d.KEEP_ALIVE_TIMEOUT_S, "server"
        ),
    )


def _read_config(config: Path | None) -> dict[str, Any]:
    """The config file's TOML (empty without one)."""
    if config is None:
        return {}
    try:
        text = config.read_text(encoding="utf-8")  # TOML is UTF-8, whatever the locale
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{config}: not UTF-8 ({exc.reason} at byte {exc.start})") from exc
    except OSError as exc:
        raise ConfigError(f"{config}: {exc}") from exc
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{config}: {exc}") from exc


def _budget_limits(raw: Mapping[str, Any], source: str) -> dict[str, int]:
    """``[budgets]``: path = limit in USD, as nano-dollars."""
    limits: dict[str, int] = {}
    for path, value in _table(raw, "budgets", source).items():
        if isinstance(value, Mapping | list | bool):  # [budgets.team] is no limit
            raise ConfigError(f'{source}: budgets.{path}: a limit is USD as a string ("5.00")')
        if isinstance(value, float):
            raise ConfigError(f"{source}: budgets.{path}: money must not be a float: {value!r}")
        try:
            budgets.validate_path(path)
            # Exact, as `budget set --limit` takes it: a limit finer than a nano-dollar is
            # refused, never rounded up (usd_to_nanos rounds, which suits prices only).
            limits[path] = typed_usd(str(value))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{source}: budgets.{path}: {exc}") from exc
    return limits


def load_settings(
    *,
    config: Path | None = None,
    ledger: str | None = None,
    host: str | None = None,
    port: int | None = None,
    provider_dirs: Sequence[Path] = (),
    upstreams: Mapping[str, str] | None = None,
    environ: Mapping[str, str] | None = None,
    name_upstream: Callable[[str], str] = upstream_argument,
    metrics_host: str | None = None,
    metrics_port: int | None = None,
    provider_ports: Mapping[str, int] | None = None,
) -> ServeSettings:
    """Build settings from a config file, flags and the environment.

    ``name_upstream`` names an ``upstreams`` entry in errors (see :func:`load_providers`).
    """
    env = os.environ if environ is None else environ
    raw = readkeys.tracked(_read_config(config))
    source = str(config) if config else "<flags>"
    server, guard, upstream = (_table(raw, t, source) for t in ("server", "guard", "upstream"))
    providers = load_providers(list(provider_dirs), upstreams, name_upstream=name_upstream)
    try:
        _retention(_table(raw, "retention", source))  # archive's table: checked here too
        settings = _serve_settings(raw, source, env, server, guard, upstream, providers)
    except ConfigError as exc:
        # values.* name the key ("guard.max_retries"); the file is named here, once.
        if config is None or str(exc).startswith(source):
            raise
        raise ConfigError(f"{source}: {exc}") from None
    settings = dataclasses.replace(
        settings,
        ledger=_flag(ledger, settings.ledger),
        host=_flag(host, settings.host),
        port=_flag(port, settings.port),
        metrics_host=_flag(metrics_host, settings.metrics_host),
        metrics_port=_flag(metrics_port, settings.metrics_port),
        provider_ports={**settings.provider_ports, **(provider_ports or {})},
    )
    check_provider_ports(settings)
    _refuse_unread(raw, source)
    return settings


def _serve_settings(
    raw: Mapping[str, Any],
    source: str,
    env: Mapping[str, str],
    server: Mapping[str, Any],
    guard: Mapping[str, Any],
    upstream: Mapping[str, Any],
    providers: Mapping[str, Provider],
) -> ServeSettings:
    """The settings the file (and environment) give, before flags override them."""
    d = defaults
    lease, heartbeat = _lease(server)
    up = upstream_table(upstream)
    return ServeSettings(
        ledger=_ledger_of(raw, source) or d.ledger_from(env),
        host=values.host(server, "host", d.HOST, "server"),
        port=values.listen_port(server),
        providers=providers,
        provider_keys=keys_from_environment(providers, env),
        guard=dataclasses.replace(
            _guard(guard),
            upstream_read_timeout_s=up.read_timeout_s,
            upstream_stream_timeout_s=up.stream_timeout_s,
        ),
        budget_limits=_budget_limits(raw, source),
        keys=(keys := tuple(proxy_keys(raw, source))),
        admin=admin_settings(_table(raw, "admin", source), source, env, keys),
        max_body_bytes=values.whole(server, "max_body_bytes", d.MAX_BODY_BYTES, "server"),
        spool_body_bytes=values.whole(
            server, "spool_body_bytes", d.SPOOL_BODY_BYTES, "server", above_zero=True
        ),
        spool_dir=values.directory(server, "spool_dir", "server"),
        drain_timeout_s=values.number(server, "drain_timeout_s", d.DRAIN_TIMEOUT_S, "server"),
        front_door=_front_door(server),
        metrics_host=values.host(server, "metrics_host", d.HOST, "server"),
        metrics_port=values.port(server, "metrics_port"),
        provider_ports=values.ports(server, "provider_ports"),
        connect_timeout_s=up.connect_timeout_s,
        read_timeout_s=up.read_timeout_s,
        upstream_connections=up.connections,
        upstream_connections_per_origin=up.connections_per_origin,
        lease_s=lease,
        heartbeat_s=heartbeat,
        sweep_s=values.positive(server, "sweep_s", d.SWEEP_S, "server"),
        key_refresh_s=values.positive(server, "key_refresh_s", d.KEY_REFRESH_S, "server"),
        **_operator(server),
    )


def _flag(flag: T | None, configured: T) -> T:
    """A flag given (not None, not empty) wins over the file's value, which is read either
    way: a key a flag overrides is still known, and still checked."""
    return configured if flag is None or flag == "" else flag


def check_provider_ports(settings: ServeSettings) -> None:
    """Refuse (``ConfigError``) a provider port for no declared provider, or one that is
    the proxy's, /metrics' or another provider's port (0, any free port, is never taken)."""
    taken = {settings.port: "the proxy's port", settings.metrics_port: "metrics_port"}
    for name, port in settings.provider_ports.items():
        if name not in settings.providers:
            raise ConfigError(f"provider_ports: no provider named {name!r} is declared")
        if port and port in taken:
            raise ConfigError(f"provider_ports: {name}'s port {port} is {taken[port]}")
        taken[port] = f"{name}'s port"


def _refuse_unread(raw: readkeys.Tracked, source: str) -> None:
    """Refuse a key nothing reads: a misspelt one would leave its setting at its default."""
    for path, asked in readkeys.unread(raw):
        near = difflib.get_close_matches(path.rsplit(".", 1)[-1], asked, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ConfigError(f"{source}: unknown key {path}{hint}")


def _guard(guard: Mapping[str, Any]) -> GuardSettings:
    """``[guard]``."""
    g = GuardSettings()
    return GuardSettings(
        retry_window_s=values.number(guard, "retry_window_s", g.retry_window_s, "guard"),
        max_retries=values.whole(guard, "max_retries", g.max_retries, "guard"),
        retry_wait_s=values.number(guard, "retry_wait_s", g.retry_wait_s, "guard"),
        create_budgets=values.boolean(guard, "create_budgets", g.create_budgets, "guard"),
        reconcile_hook=_hook_spec(guard),
        reconcile_hook_timeout_s=values.number(
            guard, "reconcile_hook_timeout_s", g.reconcile_hook_timeout_s, "guard"
        ),
        max_answer_bytes=values.whole(
            guard, "max_answer_bytes", g.max_answer_bytes, "guard", above_zero=True
        ),
    )


def _lease(server: Mapping[str, Any]) -> tuple[float, float]:
    """``lease_s`` and ``heartbeat_s``: a heartbeat as long as the lease would let the lease
    lapse between renewals, and other replicas take over a live worker (contract §7)."""
    lease = values.positive(server, "lease_s", defaults.LEASE_S, "server")
    heartbeat = values.positive(server, "heartbeat_s", defaults.HEARTBEAT_S, "server")
    if heartbeat >= lease:
        raise ConfigError(
            f"server.heartbeat_s: must be shorter than server.lease_s ({lease:g} s), or the "
            "lease lapses between renewals"
        )
    return lease, heartbeat


def _hook_spec(guard: Mapping[str, Any]) -> str | None:
    spec = guard.get("reconcile_hook")
    if spec is not None and (not isinstance(spec, str) or ":" not in spec):
        raise ConfigError("guard.reconcile_hook: must be a string module:function")
    return spec


def _operator(server: Mapping[str, Any]) -> dict[str, Any]:
    """``[server]`` log_format, log_level and otel (flags override them: with_flags)."""
    d = defaults
    return {
        "log_format": _log_format(server.get("log_format", d.LOG_FORMAT)),
        "log_level": _log_level(server.get("log_level", d.LOG_LEVEL)),
        "otel": values.boolean(server, "otel", d.OTEL, "server"),
    }


def with_operator_flags(
    settings: ServeSettings,
    *,
    log_format: str | None = None,
    log_level: str | None = None,
    otel: bool | None = None,
) -> ServeSettings:
    """``settings`` with the ``serve`` flags for logs and traces applied (None: unchanged)."""
    return dataclasses.replace(
        settings,
        log_format=_log_format(log_format or settings.log_format),
        log_level=_log_level(log_level or settings.log_level),
        otel=settings.otel if otel is None else otel,
    )


#: The log formats ``[server] log_format`` and ``--log-format`` accept.
LOG_FORMATS = ("text", "json")
#: The log levels ``[server] log_level`` and ``--log-level`` accept.
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def _log_format(value: object) -> str:
    if value not in LOG_FORMATS:
        raise ConfigError(f"server.log_format: must be one of {', '.join(LOG_FORMATS)}")
    return str(value)


def _log_level(value: object) -> str:
    level = str(value).lower()
    if level not in LOG_LEVELS:
        raise ConfigError(f"server.log_level: must be one of {', '.join(LOG_LEVELS)}")
    return level


def config_ledger(config: Path) -> str | None:
    """The ledger a config file names (``ledger = ...``), so the CLI finds serve's ledger."""
    return _ledger_of(_read_config(config), str(config))


def _ledger_of(raw: Mapping[str, Any], source: str) -> str | None:
    value = raw.get("ledger")
    if value is not None and (not isinstance(value, str) or not value or "\x00" in value):
        raise ConfigError(f"{source}: ledger must be a string (a path or a DSN)")
    return value


def config_retention(config: Path | None) -> RetentionPolicy:
    """``[retention]``: how long calls' events (with their bodies) stay in the live ledger."""
    return _retention(_table(_read_config(config), "retention", str(config)))


def _retention(table: Mapping[str, Any]) -> RetentionPolicy:
    if "keep_bodies_days" not in table:
        return RetentionPolicy()
    return RetentionPolicy(values.number(table, "keep_bodies_days", 0.0, "retention"))
