"""A Stripe-like ``payments`` tool, declared against the fake provider: ``POST /v1/send``
at most once, the call id carried as its operation id (``X-Effectguard-Op``), and lost
calls looked up through the fake provider's lagging, key-checked ``/v1/search``.

Shared by the tool-effect tests (``tests/toolkit.py``) and the simulator's ``--lookups``.
"""

from __future__ import annotations

from typing import Final

__all__ = ["declaration"]

_TEXT: Final = """
name = "payments"
base_url = "http://127.0.0.1:9"
dialect = "flat"
api_key_env = "PAYMENTS_API_KEY"
prices_taken = "2026-12-01"
{transient}
[[endpoints]]
path = "/v1/send"
effect = "at_most_once"
op_id = {{ header = "X-Effectguard-Op" }}

[endpoints.lookup]
url = "{{base_url}}/v1/search"
query = {{ op = "{{op}}" }}
applied = "data[0]"
results = "data"
not_found = [200]
freshness_s = {freshness}
timeout_s = 5

[models.default]
per_call = "{per_call}"
max_output_tokens = 0
"""


def declaration(freshness: float, *, per_call: str = "0.01", unknown_500: bool = False) -> str:
    """The declaration's TOML: its lookup's ``freshness_s``, the price of a call (USD) and,
    with ``unknown_500``, a 500 declared transient of unknown effect (a lookup decides)."""
    transient = '\n[transient]\n500 = "unknown"\n' if unknown_500 else ""
    return _TEXT.format(freshness=freshness, per_call=per_call, transient=transient)
