"""Commands that run in the foreground until stopped: ``serve`` and ``fake-provider``."""

from __future__ import annotations

import argparse
import functools
from pathlib import Path
from typing import TYPE_CHECKING

from effectguard.errors import ConfigError
from effectguard.ops.command import (
    EXIT_OK,
    Command,
    check_ledger_place,
    path_arg,
    port_arg,
    provider_options,
    upstream_flag,
    upstreams,
)

if TYPE_CHECKING:
    from effectguard.config.settings import ServeSettings


def cmd_serve(args: argparse.Namespace) -> int:
    """``effectguard serve``: the proxy (with ``--demo``, and its offline upstream)."""
    from effectguard.config.settings import load_settings, with_operator_flags
    from effectguard.ingress.serving import serve
    from effectguard.telemetry.metrics import Metrics

    overrides = upstreams(args)
    load = functools.partial(
        load_settings,
        config=Path(args.config) if args.config else None,
        ledger=args.ledger,
        host=args.host,
        port=args.port,
        provider_dirs=[Path(p) for p in args.providers or ()],
        name_upstream=upstream_flag,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        provider_ports=provider_ports(args),
    )
    demo = None
    if args.demo:
        from effectguard.ops.demo import DemoUpstream

        demo = DemoUpstream()
        # An explicit --upstream still wins over the demo's.
        settings = load(upstreams=demo.upstreams(overrides))
        if demo.port in (taken := _listen_ports(settings)):
            # The kernel may give the demo a port the proxy is about to bind: neither
            # listens yet, so both binds succeed and the proxy never hears a request.
            demo = demo.elsewhere(taken)
            settings = load(upstreams=demo.upstreams(overrides))
    else:
        settings = load(upstreams=overrides)
    settings = with_operator_flags(
        settings, log_format=args.log_format, log_level=args.log_level, otel=args.otel or None
    )
    # Before anything is started or written (the demo's receipt log goes beside the
    # ledger): a bad path is one line and exit 2, not a traceback from the lifespan.
    check_ledger_place(settings.ledger)
    alongside = None
    if demo is not None:
        from effectguard.ops.demo import receipts_path

        alongside = functools.partial(demo.running, receipts_path(settings.ledger))
    serve(settings, metrics=Metrics(), alongside=alongside)
    return EXIT_OK


def _serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ledger",
        type=path_arg,
        default=None,
        help=(
            "ledger PATH or DSN (default: the --config file's ledger, else "
            "$EFFECTGUARD_LEDGER, else ./effectguard.db)"
        ),
    )
    p.add_argument("--host", default=None, help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=port_arg, default=None, help="port (default 8787)")
    provider_options(p)
    p.add_argument(
        "--config", type=path_arg, metavar="FILE", help="TOML config (budgets, keys, limits)"
    )
    p.add_argument(
        "--demo",
        action="store_true",
        help="also run the fake provider in this process and point openai and anthropic at it "
        "(offline; its receipt log goes beside the ledger)",
    )
    p.add_argument(
        "--metrics-port",
        type=port_arg,
        default=None,
        help="serve /metrics on its own listener at this port (and not on the proxy's)",
    )
    p.add_argument(
        "--metrics-host", default=None, help="address for --metrics-port (default 127.0.0.1)"
    )
    p.add_argument(
        "--provider-port",
        action="append",
        metavar="NAME=PORT",
        help="also listen on PORT, routing every path there to provider NAME, no /NAME/ "
        "prefix: for an SDK that drops a base URL's path (repeatable)",
    )
    _operator_arguments(p)
    p.set_defaults(run=cmd_serve)


def _listen_ports(settings: ServeSettings) -> set[int]:
    """The ports ``serve`` binds for itself (the proxy, /metrics, the provider ports)."""
    ports = {settings.port, *settings.provider_ports.values()}
    if settings.metrics_port is not None:
        ports.add(settings.metrics_port)
    return ports


def provider_ports(args: argparse.Namespace) -> dict[str, int]:
    """The ``--provider-port NAME=PORT`` flags as a mapping."""
    out = {}
    for item in args.provider_port or ():
        name, sep, port = item.partition("=")
        try:
            if not sep:
                raise argparse.ArgumentTypeError("")
            out[name] = port_arg(port)
        except argparse.ArgumentTypeError:
            raise ConfigError(
                f"--provider-port takes NAME=PORT (0 to 65535), got {item!r}"
            ) from None
    return out


def _operator_arguments(p: argparse.ArgumentParser) -> None:
    """Logs and traces: what the proxy tells its operator."""
    from effectguard.config.settings import LOG_FORMATS, LOG_LEVELS

    p.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=None,
        help="text (default) or json: one JSON object per line, for log shippers",
    )
    p.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        type=str.lower,
        default=None,
        help="effectguard's log level (default info: one access line per call)",
    )
    p.add_argument(
        "--otel",
        action="store_true",
        help="one OpenTelemetry span per call (needs effectguard[otel]; exporters are "
        "configured by the OTEL_* environment variables of the OpenTelemetry SDK)",
    )


def _fake_provider_arguments(p: argparse.ArgumentParser) -> None:
    from effectguard.testing import fakeprovider

    fakeprovider.add_arguments(p)
    p.set_defaults(run=fakeprovider.run)


SERVE = Command("serve", "run the proxy", "Run the HTTP proxy.", _serve_arguments)
FAKE_PROVIDER = Command(
    "fake-provider",
    "run the synthetic provider for tests",
    "Run a synthetic OpenAI/Anthropic-compatible provider.",
    _fake_provider_arguments,
)


def _sim_arguments(p: argparse.ArgumentParser) -> None:
    from effectguard.testing import sim

    sim.add_arguments(p)
    p.set_defaults(run=sim.main)


SIM = Command(
    "sim",
    "run the fault simulator",
    "Run a seeded schedule of load and faults against real processes; check the invariants.",
    _sim_arguments,
)
