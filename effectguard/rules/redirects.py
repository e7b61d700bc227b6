"""Where a provider's redirect leads a client of the proxy. Pure.

effectguard never follows a redirect (contract §1.4), but the OpenAI and Anthropic SDKs
do, by themselves: a ``Location`` on the provider's own origin, passed on as the provider
wrote it, would send the SDK's repeat of a request straight to the provider, past every
budget and out of the ledger. :func:`proxy_location` writes such a ``Location`` as the
proxy's own path for that provider, so a followed redirect comes back through the guard.
Anything else (another origin, a path outside the provider's base URL, a dot segment) is
left as written, and :func:`shown_location` is how a log line names it.
"""

from __future__ import annotations

from urllib.parse import SplitResult, unquote, urljoin, urlsplit, urlunsplit

__all__ = ["proxy_location", "shown_location"]

_DEFAULT_PORTS = {"http": 80, "https": 443}


def _origin(url: SplitResult) -> tuple[str, str | None, int | None]:
    """Scheme, host and port (the scheme's default where none is written)."""
    scheme = url.scheme.lower()
    return scheme, url.hostname, url.port or _DEFAULT_PORTS.get(scheme)


def proxy_location(location: str, sent_to: str, base_url: str, mount: str) -> str | None:
    """``location`` (resolved against ``sent_to``, the URL the request went to) as a path
    on the proxy, ``mount`` (``/openai``; ``""`` on a provider's own listener) followed by
    its path below ``base_url``, its query and fragment; None if it points anywhere else."""
    try:
        target = urlsplit(urljoin(sent_to, location))
        base = urlsplit(base_url)
        if _origin(target) != _origin(base):
            return None
    except ValueError:  # a port that is no number, an unclosed IPv6 bracket
        return None
    base_path = base.path.rstrip("/")
    path = target.path or "/"
    if path != base_path and not path.startswith(base_path + "/"):
        return None
    below = path[len(base_path) :] or "/"
    # A dot segment (a client resolves it, %2e too) could climb out of the mount; two
    # slashes or a backslash at the start would name another host to a browser.
    if {".", ".."} & {unquote(s) for s in below.split("/")} or "\\" in below:
        return None
    if below.startswith("//"):
        return None
    query = f"?{target.query}" if target.query else ""
    fragment = f"#{target.fragment}" if target.fragment else ""
    return f"{mount}{below}{query}{fragment}"


def shown_location(location: str) -> str:
    """``location`` as a log line may hold it: no user part, no fragment, and its query
    (which may carry a credential) as ``?…``."""
    try:
        url = urlsplit(location)
    except ValueError:
        return "(an unreadable URL)"
    netloc = url.netloc.rpartition("@")[2]
    shown = urlunsplit((url.scheme, netloc, url.path, "", ""))
    return f"{shown}?…" if url.query else shown
