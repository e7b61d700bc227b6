"""A model's list prices, as the cost rules read them (declared in provider files)."""

from __future__ import annotations

from dataclasses import dataclass

from effectguard.rules.money import Nanos


@dataclass(frozen=True, slots=True)
class ModelPrice:
    """List prices of one model, in nano-dollars (per million tokens, or per call)."""

    input: Nanos
    output: Nanos
    cached_input: Nanos | None = None
    cache_write: Nanos | None = None
    max_output_tokens: int = 4096
    per_call: Nanos | None = None
