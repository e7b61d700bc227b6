"""A lookup URL carries its operation's key as one segment, whatever the key holds.

A call an older release sent with the client's own Idempotency-Key as the provider key is
looked up by that key, and the client chose it: ``../x`` or ``a/b?c`` placed raw in
``{base_url}/ops/{key}`` left the base path (``--upstream`` may point a provider at
``http://host/tenant1``; contract §12) or added a query, with the provider's credential.
"""

from __future__ import annotations

from urllib.parse import unquote

import httpx
import pytest

from effectguard.callpath.resolve import lookup_request
from effectguard.providers import load_providers

BASE = "http://tool.test/tenant1"
TOOL = load_providers([], {"send_email": BASE})["send_email"]


@pytest.mark.parametrize(
    "key",
    ["../x", "../../admin?delete=1", "a/b?c", "a#b", "k&other=1", "50%2f50", "..", ".", "ok-1"],
)
def test_a_hostile_key_stays_one_segment_under_the_base_path(key: str) -> None:
    lookup = TOOL.default_lookup
    assert lookup is not None
    request = lookup_request(TOOL, lookup, key, credential="Bearer sk")
    url = httpx.URL(request.url)
    assert (url.host, url.query, url.fragment) == ("tool.test", b"", "")
    prefix = "/tenant1/ops/"
    assert url.raw_path.decode().startswith(prefix)
    segment = url.raw_path.decode().removeprefix(prefix)
    assert "/" not in segment and unquote(segment) == key
