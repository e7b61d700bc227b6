"""Which provider ``Location`` becomes the proxy's path, and how a log names the others."""

from __future__ import annotations

import pytest

from effectguard.rules.redirects import proxy_location, shown_location

SENT = "https://api.example.com/api/v1/chat/completions?x=1"
BASE = "https://api.example.com/api"


@pytest.mark.parametrize(
    ("location", "proxied"),
    [
        ("https://api.example.com/api/v1/chat2", "/openai/v1/chat2"),
        ("https://API.example.com:443/api/v1/chat2?a=b#f", "/openai/v1/chat2?a=b#f"),
        ("/api/v2/x", "/openai/v2/x"),
        ("completions2", "/openai/v1/chat/completions2"),
        ("https://api.example.com/api", "/openai/"),
        ("https://api.example.com/api/v1/%2fx", "/openai/v1/%2fx"),
    ],
)
def test_a_location_below_the_base_url_becomes_the_proxys_path(location: str, proxied: str) -> None:
    """Absolute or relative (resolved against the URL the request went to), with its query
    and fragment, and the default port spelled out or not."""
    assert proxy_location(location, SENT, BASE, "/openai") == proxied


@pytest.mark.parametrize(
    "location",
    [
        "https://elsewhere.example/api/v1/x",
        "http://api.example.com/api/v1/x",
        "https://api.example.com:8443/api/v1/x",
        "https://api.example.com/other/v1/x",
        "https://api.example.com/apiv1/x",
        "//elsewhere.example/api/v1/x",
        "https://api.example.com/api/v1/../../../anthropic/v1/messages",
        "https://api.example.com/api/v1/%2e%2e/x",
        "https://api.example.com/api/./v1",
        "https://api.example.com/api//elsewhere.example/x",
        "https://api.example.com/api/\\elsewhere.example",
        "https://api.example.com:port/api/v1/x",
        "https://[::1/api/v1/x",
    ],
)
def test_a_location_anywhere_else_is_left_as_written(location: str) -> None:
    """Another origin (scheme, host or port), a path outside the base, or a path that a
    client would resolve out of the provider's mount: None (passed on as it came)."""
    assert proxy_location(location, SENT, BASE, "/openai") is None


def test_on_a_providers_own_listener_the_path_is_the_whole_path() -> None:
    """With no mount (``provider_ports``), the path below the base is the proxy's path."""
    base = "https://api.example.com"
    assert proxy_location("/v1/x?q", SENT, base, "") == "/v1/x?q"
    assert proxy_location("//elsewhere.example/x", SENT, base, "") is None


@pytest.mark.parametrize(
    ("location", "shown"),
    [
        ("https://u:pw@elsewhere.example/v1/x?token=s#frag", "https://elsewhere.example/v1/x?…"),
        ("https://elsewhere.example/v1/x", "https://elsewhere.example/v1/x"),
        ("https://[::1/x?k=1", "(an unreadable URL)"),
    ],
)
def test_a_location_is_logged_without_its_query_or_user(location: str, shown: str) -> None:
    """A query or a user part may carry a credential: neither reaches a log line."""
    assert shown_location(location) == shown
