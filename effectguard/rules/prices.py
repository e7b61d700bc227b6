"""A model's list prices, as the cost rules read them (declared in provider files)."""

from __future__ import annotations

from dataclasses import dataclass

from effectguard.rules.money import Nanos


@dataclass(frozen=True, slots=True)
class ModelPrice:
    """List prices of one model, in nano-dollars (per million tokens, or per call).

    ``web_search`` is per search request a server tool makes in the call (Anthropic's
    ``usage.server_tool_use.web_search_requests``): billed apart from the tokens.
    """

    input: Nanos
    output: Nanos
    cached_input: Nanos | None = None
    cache_write: Nanos | None = None
    max_output_tokens: int = 4096
    per_call: Nanos | None = None
    web_search: Nanos | None = None
