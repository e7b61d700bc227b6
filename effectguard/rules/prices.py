"""A model's list prices, as the cost rules read them (declared in provider files)."""

from __future__ import annotations

from dataclasses import dataclass

from effectguard.rules.money import Nanos


@dataclass(frozen=True, slots=True)
class ModelPrice:
    """List prices of one model, in nano-dollars (per million tokens, or per call).

    ``cache_write_1h`` prices the cache writes an answer reports as kept for an hour
    (Anthropic's ``cache_creation.ephemeral_1h_input_tokens``; ``cache_write`` is the
    5-minute write). ``web_search`` is per search request a server tool makes in the call
    (Anthropic's ``usage.server_tool_use.web_search_requests``): billed apart from tokens.
    ``audio_minute`` is per minute of audio an answer reports (OpenAI's whisper-1
    ``usage.seconds``): where an answer reports it, it replaces ``per_call``, which then
    stands in for one minute only where the answer does not say.
    """

    input: Nanos
    output: Nanos
    cached_input: Nanos | None = None
    cache_write: Nanos | None = None
    cache_write_1h: Nanos | None = None
    max_output_tokens: int = 4096
    per_call: Nanos | None = None
    web_search: Nanos | None = None
    audio_minute: Nanos | None = None
