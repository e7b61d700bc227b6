"""Exact money: integer nano-dollars.

Every amount inside effectguard is an ``int`` of nano-dollars (1e-9 USD). Floats
never touch money: prices come from TOML as strings, tokens are integers, and
USD appears only at the edges (CLI, JSON, metrics) as a decimal string.
"""

from __future__ import annotations

import re
from decimal import ROUND_CEILING, Decimal, InvalidOperation, localcontext

NANOS_PER_USD = 1_000_000_000
TOKENS_PER_MILLION = 1_000_000

Nanos = int
"""An amount of money in nano-dollars."""

MAX_NANOS: Nanos = 2**63 - 1
"""The most a stored counter holds: SQLite's INTEGER and PostgreSQL's bigint are signed
64-bit (about 9.2 billion USD). Budget counters saturate here instead of overflowing."""

MAX_CALL_NANOS: Nanos = 2**53
"""The most one call may reserve or be charged (about 9 million USD). Far above any real
call, and far enough below :data:`MAX_NANOS` that a counter holds a thousand such calls;
admission refuses a reservation that would take any counter past :data:`MAX_NANOS`."""


#: Amounts at or above 10**31 USD are beyond every bound (MAX_NANOS is about 9.2e9 USD).
_MAX_EXPONENT = 30
_NANO_DIGITS = 10


def usd_to_nanos(value: str | int | Decimal) -> Nanos:
    """Parse a USD amount (``"0.15"``, ``Decimal``, ``int``) into nano-dollars.

    Rounds up to the next nano-dollar: a price is never understated. Floats are
    refused, because a float price has already lost its exact value.
    """
    if isinstance(value, bool | float):
        raise TypeError(f"money must not be a float or bool: {value!r}")
    try:
        amount = Decimal(value) if not isinstance(value, Decimal) else value
    except InvalidOperation as exc:
        raise ValueError(f"not a USD amount: {value!r}") from exc
    if not amount.is_finite():
        raise ValueError(f"not a finite USD amount: {value!r}")
    if amount.adjusted() > _MAX_EXPONENT:
        # No counter holds it: refused before the arithmetic, which would overflow
        # Decimal's context or build an integer of a million digits.
        raise ValueError(f"USD amount out of range: {value!r}")
    if amount.adjusted() < -_NANO_DIGITS:
        # Less than a tenth of a nano-dollar; scaling it would underflow to 0.
        return 1 if amount > 0 else 0
    return int((amount * NANOS_PER_USD).to_integral_value(rounding=ROUND_CEILING))


#: A USD amount as an operator writes one: ASCII digits, a point, an exponent; no sign,
#: no ``_``, no ``NaN`` or ``inf``, no other script's digits (``Decimal`` takes them all).
_TYPED_USD = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?", re.ASCII)


def typed_usd(text: str, bound: Nanos = MAX_NANOS, what: str = "amount") -> Nanos:
    """An amount a person typed (a limit, a call's cost), exactly: ``ValueError`` for
    anything but ASCII digits with one optional point and exponent (no sign, no ``_``, no
    other script's digits), for a negative amount, one finer than a nano-dollar (never
    rounded), or one outside ``0..bound``."""
    text = text.strip()
    if text.startswith("-") and _TYPED_USD.fullmatch(text[1:]):
        raise ValueError("amounts cannot be negative")
    if not _TYPED_USD.fullmatch(text):
        raise ValueError(f"not a USD amount: {text!r} (e.g. 12.50)")
    amount = Decimal(text)
    out_of_range = f"{what} must be between 0 and {nanos_to_usd(bound)} USD"
    if amount.adjusted() > 20:  # far past any bound: refused before any arithmetic on it
        raise ValueError(out_of_range)
    # Exact arithmetic (enough digits for every digit given): an amount is never rounded.
    with localcontext(prec=len(text) + 40):
        nanos = amount.scaleb(9)
        if amount and (amount.adjusted() < -10 or nanos != nanos.to_integral_value()):
            raise ValueError(f"{text} USD is finer than a nano-dollar (at most 9 decimal places)")
    return check_amount(int(nanos), bound, what)


def check_amount(nanos: Nanos, bound: Nanos = MAX_NANOS, what: str = "amount") -> Nanos:
    """Return ``nanos`` if it lies in ``0..bound``, else raise ``ValueError`` naming ``what``."""
    if not 0 <= nanos <= bound:
        raise ValueError(f"{what} must be between 0 and {nanos_to_usd(bound)} USD")
    return nanos


def nanos_to_usd(nanos: Nanos) -> str:
    """Format nano-dollars as an exact decimal USD string (``"0.000150000"``)."""
    sign = "-" if nanos < 0 else ""
    whole, frac = divmod(abs(nanos), NANOS_PER_USD)
    return f"{sign}{whole}.{frac:09d}"


def nanos_to_decimal(nanos: Nanos) -> Decimal:
    """Nano-dollars as an exact ``Decimal`` of USD."""
    return Decimal(nanos) / NANOS_PER_USD


def token_cost(tokens: int, usd_per_million: Nanos) -> Nanos:
    """Cost of ``tokens`` at a price given in nano-dollars per million tokens.

    Rounds up: a fraction of a nano-dollar is charged as a whole one.
    """
    if tokens <= 0 or usd_per_million <= 0:
        return 0
    return -(-tokens * usd_per_million // TOKENS_PER_MILLION)
