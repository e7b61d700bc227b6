"""Which declared provider a request URL is for (the in-process way in routes by URL).

Pure: a request's method and URL in, a :class:`Provider` (or None) out.
"""

from __future__ import annotations

from collections.abc import Iterable

from effectguard.providers.provider import Provider


def provider_for(providers: Iterable[Provider], method: str, url: str) -> Provider | None:
    """The provider a ``method url`` request (``url`` without query) is for, or None.

    The provider with the longest base URL that ``url`` falls under wins. Several
    providers may share that base URL (the quick start points ``openai`` and
    ``anthropic`` at one fake provider): then the one that declares an endpoint for
    the request's method and path wins, and where that still leaves a tie (or no
    declaration matches), the first one given.
    """
    under: list[tuple[str, Provider]] = []
    for provider in providers:
        base = provider.base_url.rstrip("/")
        # A backslash after the base is under it too: servers that read ``\`` as ``/``
        # would resolve ``base\..\x`` outside it, so the path check must see it and
        # refuse it, not let it pass as a request for nobody.
        if url == base or url.startswith((base + "/", base + "\\")):
            under.append((base, provider))
    if not under:
        return None
    longest = max(len(base) for base, _ in under)
    sharing = [(base, p) for base, p in under if len(base) == longest]
    path = url[longest:] or "/"
    declared = [p for _, p in sharing if p.endpoint_for(method, path) is not None]
    return (declared or [p for _, p in sharing])[0]
