"""Usage and cost: what a provider says a call consumed, and what that costs.

Pure functions, no I/O. Usage is read from a response body (:func:`usage_from_body`; a
server-sent-event stream's is read by :mod:`effectguard.rules.streamusage`), judged by the
docs/contract.md §3.7 belief rules (:func:`check_usage`), and priced exactly in nano-dollars
(:func:`cost`). :func:`estimate` is the docs/contract.md §5 reservation made before dispatch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from effectguard.rules.money import MAX_CALL_NANOS, TOKENS_PER_MILLION, Nanos, nanos_to_usd
from effectguard.rules.prices import ModelPrice
from effectguard.rules.quickinit import quick_init

__all__ = [
    "MAX_CHOICES",
    "OUTPUT_LIMIT_FIELDS",
    "OutOfBounds",
    "Usage",
    "UsageResult",
    "check_usage",
    "choices",
    "cost",
    "estimate",
    "usage_from_body",
    "wants_stream",
    "with_stream_usage",
]

ABSURD_TOKENS = 2**53
"""More tokens than this in one call is not believed (docs/contract.md §3.7)."""

OUTPUT_LIMIT_FIELDS = ("max_completion_tokens", "max_output_tokens", "max_tokens")
"""Request fields that cap a call's output tokens (OpenAI chat, Responses, both dialects)."""

MAX_CHOICES = 128
"""The most choices one request may ask for (``n``, ``best_of``): OpenAI's documented cap."""


class OutOfBounds(ValueError):
    """A request field the reservation depends on is not an integer in its bounds.

    ``field`` names it, so the refusal can say which one (docs/contract.md §12, isolation).
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@quick_init
@dataclass(frozen=True, slots=True)
class Usage:
    """Tokens one call consumed, as the provider reports them.

    ``input_tokens`` counts every input token, including cached reads and cache writes.
    ``cache_write_1h_tokens`` is the part of ``cache_write_tokens`` kept for an hour, which
    Anthropic bills higher than a 5-minute write. ``web_search_requests`` counts the
    searches a server tool made (Anthropic's web search): each is billed apart from tokens.
    ``audio_ms`` is the audio an answer says it transcribed (whisper-1), in milliseconds.
    ``items`` is how many results an answer priced per result lists (dall-e-2's images);
    0 where it lists none, which is priced as one.
    """

    input_tokens: int
    output_tokens: int
    cached_input_tokens: int = 0
    cache_write_tokens: int = 0
    web_search_requests: int = 0
    cache_write_1h_tokens: int = 0
    audio_ms: int = 0
    items: int = 0

    def to_dict(self) -> dict[str, int]:
        """The usage as a JSON-ready dict (for the ledger's ``attempt.observed``).

        ``web_search_requests`` and ``cache_write_1h_tokens`` are there only when not zero,
        so the usage of every other
        call keeps the four counts the ledger's compact form stores as an array."""
        counts = {
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "cached_input_tokens": self.cached_input_tokens,
            "cache_write_tokens": self.cache_write_tokens,
        }
        if self.web_search_requests:
            counts["web_search_requests"] = self.web_search_requests
        if self.cache_write_1h_tokens:
            counts["cache_write_1h_tokens"] = self.cache_write_1h_tokens
        if self.audio_ms:
            counts["audio_ms"] = self.audio_ms
        if self.items:
            counts["items"] = self.items
        return counts


@quick_init
@dataclass(frozen=True, slots=True)
class UsageResult:
    """Usage read from a response, and why it is not believed (``problem``), if it is not.

    ``usage`` is kept whenever it could be read, even when not believed, so the ledger shows
    what the provider claimed.
    """

    usage: Usage | None
    problem: str | None

    @property
    def believed(self) -> bool:
        """Whether the usage may be used to settle the call."""
        return self.usage is not None and self.problem is None


class _Unreadable(Exception):
    """Usage fields are absent ("missing") or not integers ("malformed")."""

    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem


def _api(dialect: str, path: str) -> str:
    """Which response shape ``path`` answers with: chat, embeddings, responses, messages, flat."""
    path = path.split("?", 1)[0].rstrip("/")
    if dialect == "flat":
        return "flat"
    if dialect == "anthropic":
        return "messages"
    if path.endswith("/responses"):
        return "responses"
    if path.endswith("/embeddings"):
        return "embeddings"
    return "chat"  # chat/completions and legacy completions share the usage shape


#: Why usage reporting far more output than the request allowed is not believed.
BEYOND_CAP = "beyond the request's output cap"
#: How many times its output cap a call's reported output may be and still be believed.
CAP_SLACK = 2


def check_usage(usage: Usage) -> str | None:
    """Why ``usage`` is not believed (docs/contract.md §3.7), or None when it is."""
    counts = (
        usage.input_tokens,
        usage.output_tokens,
        usage.cached_input_tokens,
        usage.cache_write_tokens,
        usage.web_search_requests,
        usage.cache_write_1h_tokens,
        usage.audio_ms,
        usage.items,
    )
    if any(n < 0 for n in counts):
        return "negative"
    if any(n > ABSURD_TOKENS for n in counts):
        return "absurd"
    if usage.cached_input_tokens + usage.cache_write_tokens > usage.input_tokens:
        return "cached exceeds input"
    if usage.cache_write_1h_tokens > usage.cache_write_tokens:
        return "cached exceeds input"
    if usage.items > MAX_CHOICES:
        return "absurd"  # more results than any request may ask for
    return None


def _int(obj: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = obj.get(key)
    if value is None:
        if default is None:
            raise _Unreadable("missing")
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Unreadable("malformed")
    return value


def _table(obj: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = obj.get(key)
    return value if isinstance(value, dict) else {}


def _openai_usage(u: Mapping[str, Any], api: str, output: object = None) -> Usage:
    if api == "responses" or ("prompt_tokens" not in u and "input_tokens" in u):
        # The Responses API (and newer endpoints such as images) name it input/output.
        return Usage(
            input_tokens=_int(u, "input_tokens"),
            output_tokens=_int(u, "output_tokens"),
            cached_input_tokens=_int(_table(u, "input_tokens_details"), "cached_tokens", 0),
            web_search_requests=web_search_calls(output),
        )
    return Usage(
        input_tokens=_int(u, "prompt_tokens"),
        output_tokens=0 if api == "embeddings" else _int(u, "completion_tokens"),
        cached_input_tokens=_int(_table(u, "prompt_tokens_details"), "cached_tokens", 0),
    )


def web_search_calls(output: object) -> int:
    """The searches a Responses answer's built-in web search tool made: its ``output``
    items of type ``web_search_call``. They are billed per call, apart from the tokens,
    and the usage does not count them."""
    if not isinstance(output, list):
        return 0
    return sum(1 for item in output if isinstance(item, dict) and item.get("type") == _SEARCH)


_SEARCH = "web_search_call"


def _anthropic_usage(u: Mapping[str, Any], output_tokens: int | None = None) -> Usage:
    # Anthropic's input_tokens exclude cache reads and writes; Usage counts all input.
    read = _int(u, "cache_read_input_tokens", 0)
    write = _int(u, "cache_creation_input_tokens", 0)
    return Usage(
        input_tokens=_int(u, "input_tokens") + read + write,
        output_tokens=_int(u, "output_tokens") if output_tokens is None else output_tokens,
        cached_input_tokens=read,
        cache_write_tokens=write,
        # Server tools bill per use, apart from tokens: web search is 10 USD per thousand,
        # often far more than the call's tokens, and only this count says how many ran.
        web_search_requests=_int(_table(u, "server_tool_use"), "web_search_requests", 0),
        # A 1-hour cache write costs 2x input, not the 5-minute 1.25x: only this split says
        # which writes were which (cache_creation_input_tokens is their sum).
        cache_write_1h_tokens=_int(_table(u, "cache_creation"), "ephemeral_1h_input_tokens", 0),
    )


def _judged(usage: Usage) -> UsageResult:
    return UsageResult(usage, check_usage(usage))


def usage_from_body(dialect: str, path: str, body: bytes) -> UsageResult:
    """Usage from a non-streaming JSON response body of ``dialect`` at ``path``.

    A flat (per-call priced) provider's JSON body yields zero tokens: its price is per call.
    """
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        # RecursionError: an answer nested past the parser's stack (the provider answered;
        # only its usage cannot be read, so the call settles as with no usage at all).
        return UsageResult(None, "missing")
    if not isinstance(doc, dict):
        return UsageResult(None, "missing")
    api = _api(dialect, path)
    if api == "flat":
        return UsageResult(Usage(0, 0), None)
    u = doc.get("usage")
    if not isinstance(u, dict):
        return UsageResult(None, "missing")
    try:
        if api == "messages":
            usage = _anthropic_usage(u)
        else:
            usage = _openai_usage(u, api, doc.get("output") if api == "responses" else None)
    except _Unreadable as exc:
        return UsageResult(None, exc.problem)
    return _judged(usage)


def _ceil_nanos(nano_token_product: int) -> Nanos:
    """Nano-dollars for a sum of tokens x (nano-dollars per million), rounded up once."""
    return -(-nano_token_product // TOKENS_PER_MILLION)


def cost(price: ModelPrice, usage: Usage) -> Nanos:
    """The exact cost of ``usage`` at ``price``, in nano-dollars, rounded up to a whole nano.

    Uncached input at the input price, cached reads at ``cached_input`` and cache writes at
    ``cache_write`` (each falling back to the input price where undeclared; 1-hour writes at
    ``cache_write_1h``, falling back to ``cache_write``), output at the
    output price, plus the per-call price and each server web search at ``web_search``.
    """
    cached_price = price.input if price.cached_input is None else price.cached_input
    write_price = price.input if price.cache_write is None else price.cache_write
    hour_price = write_price if price.cache_write_1h is None else price.cache_write_1h
    uncached = max(0, usage.input_tokens - usage.cached_input_tokens - usage.cache_write_tokens)
    hour_writes = max(0, min(usage.cache_write_1h_tokens, usage.cache_write_tokens))
    total = (
        uncached * price.input
        + max(0, usage.cached_input_tokens) * cached_price
        + max(0, usage.cache_write_tokens - hour_writes) * write_price
        + hour_writes * hour_price
        + max(0, usage.output_tokens) * price.output
    )
    searches = max(0, usage.web_search_requests) * (price.web_search or 0)
    # Each result an answer lists (an image) is billed at the per-call price.
    per_call = (price.per_call or 0) * max(1, usage.items)
    if usage.audio_ms > 0 and price.audio_minute is not None:
        # The audio's own length replaces per_call, its one-minute stand-in.
        per_call = -(-usage.audio_ms * price.audio_minute // 60_000)
    return _ceil_nanos(total) + per_call + searches


def _json_bytes(value: object) -> int:
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())


def _content_bytes(content: object) -> int:
    """UTF-8 bytes of prompt content: a string, token ids, or a list of parts or items."""
    if content is None:
        return 0
    if isinstance(content, str):
        return len(content.encode())
    if isinstance(content, int) and not isinstance(content, bool):
        return 1  # a token id (completions and embeddings accept token arrays)
    if isinstance(content, list):
        return sum(_content_bytes(part) for part in content)
    if isinstance(content, dict):
        if isinstance(content.get("text"), str):
            return len(content["text"].encode())
        if "content" in content:  # a message, a Responses input item, a tool result
            extra = content.get("tool_calls")
            return _content_bytes(content["content"]) + (_json_bytes(extra) if extra else 0)
        # Images, files, tool calls: their JSON, a generous stand-in for their tokens.
        return _json_bytes(content)
    return _json_bytes(content)


def _bounded_int(request: Mapping[str, Any], key: str, low: int, high: int, why: str) -> int | None:
    """``request[key]`` if absent or an integer in ``low..high``, else :class:`OutOfBounds`."""
    value = request.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise OutOfBounds(key, f"{key} must be an integer between {low} and {high} ({why})")
    return value


def _output_bound(price: ModelPrice, request: Mapping[str, Any]) -> int:
    """Output tokens the request may generate: its cap (or the model's) times its choices.

    Every field read here is checked against its bound: a cap above the model's declared
    maximum, or more choices than :data:`MAX_CHOICES`, is refused, never multiplied out.
    """
    declared = price.max_output_tokens
    for key in OUTPUT_LIMIT_FIELDS:
        _bounded_int(request, key, 0, declared, "the model's declared maximum")
    cap = _stated_cap(request)
    return (declared if cap is None else cap) * choices(request)


def _stated_cap(request: Mapping[str, Any]) -> Any:
    """The first output cap the request states (:data:`OUTPUT_LIMIT_FIELDS`), or None."""
    return next((request[k] for k in OUTPUT_LIMIT_FIELDS if request.get(k) is not None), None)


def output_cap(request: Mapping[str, Any], dialect: str) -> int | None:
    """The most output tokens the request allows (its cap times its choices), or None
    where it states no cap (a ``flat`` tool's body has none). Read after
    :func:`reservation`, which refused any cap or count out of its bounds."""
    if dialect == "flat":
        return None
    cap = _stated_cap(request)
    return None if cap is None else int(cap) * choices(request)


def choices(request: Mapping[str, Any]) -> int:
    """How many results the request asks for: ``n`` (or legacy ``best_of``), at least 1.

    Each choice generates up to the output bound, and each image is billed at the model's
    per-call price; a count out of 1..:data:`MAX_CHOICES` is :class:`OutOfBounds`."""
    counts = [
        _bounded_int(request, key, 1, MAX_CHOICES, "the most choices a request may ask for")
        for key in ("n", "best_of")
    ]
    return max(1, *(c or 1 for c in counts))


def estimate(price: ModelPrice, request: Mapping[str, Any], *, dialect: str = "openai") -> Nanos:
    """The docs/contract.md §5 reservation R for ``request`` at ``price``, in nano-dollars.

    Input bound: the UTF-8 byte length of the prompt content (messages, system, prompt,
    input, instructions, and the JSON of tool definitions) at the input price. Output bound:
    the request's max tokens, else the model's declared maximum, at the output price (an
    embeddings model's output price is zero). Plus the per-call price, once per result the
    request asks for (``n``). A ``flat`` (per-call
    priced tool) body is the tool's own: its fields are not token caps or choice counts.

    Raises :class:`OutOfBounds` for a token cap or choice count out of its bounds, and for
    a reservation beyond :data:`~effectguard.rules.money.MAX_CALL_NANOS`."""
    return reservation(price, request, dialect=dialect)[0]


def reservation(
    price: ModelPrice, request: Mapping[str, Any], *, dialect: str = "openai"
) -> tuple[Nanos, int]:
    """Both :func:`estimate` and :func:`estimate_tokens`, from one walk of the body."""
    input_bytes, output = _bounds(price, request, dialect)
    total = input_bytes * price.input + output * price.output
    searches = _search_bound(request) * (price.web_search or 0)
    # A tool's (flat) body is its own: its fields are no result counts.
    per_call = price.per_call or 0
    if per_call and dialect != "flat":  # read only where a per-call price is multiplied
        per_call *= choices(request)
    reserve = _ceil_nanos(total) + per_call + searches
    if reserve > MAX_CALL_NANOS:
        raise OutOfBounds(
            "tools"
            if searches * 2 > reserve
            else "max_tokens"
            if input_bytes * price.input < total // 2
            else "messages",
            f"this request would reserve more than {nanos_to_usd(MAX_CALL_NANOS)} USD, "
            "the most one call may reserve",
        )
    return reserve, input_bytes + output


def _search_bound(request: Mapping[str, Any]) -> int:
    """The searches a request's server web search tools may make: their ``max_uses``.

    A tool without ``max_uses`` has no bound the request states, so it adds nothing here:
    the settlement still charges every search the answer reports (an overshoot, §5.3)."""
    tools = request.get("tools")
    if not isinstance(tools, list):
        return 0
    bound = 0
    for tool in tools:
        if not isinstance(tool, dict) or not str(tool.get("type", "")).startswith("web_search"):
            continue
        uses = tool.get("max_uses")
        if isinstance(uses, int) and not isinstance(uses, bool) and uses > 0:
            bound += uses
    return bound


def estimate_tokens(price: ModelPrice, request: Mapping[str, Any], *, dialect: str) -> int:
    """A ``tpm`` limit's tokens at admission: :func:`estimate`'s bounds before prices."""
    return sum(_bounds(price, request, dialect))


def _bounds(price: ModelPrice, request: Mapping[str, Any], dialect: str) -> tuple[int, int]:
    """docs/contract.md §5's upper bounds: input (prompt content bytes) and output tokens."""
    input_bytes = sum(
        _content_bytes(request.get(key))
        for key in ("messages", "system", "prompt", "input", "instructions")
    )
    input_bytes += sum(
        _json_bytes(request[key]) for key in ("tools", "functions") if request.get(key)
    )
    return input_bytes, 0 if dialect == "flat" else _output_bound(price, request)


def wants_stream(request: Mapping[str, Any]) -> bool:
    """Whether the request asks for a server-sent-event stream."""
    return request.get("stream") is True


def with_stream_usage(dialect: str, path: str, request: dict[str, Any]) -> dict[str, Any] | None:
    """A copy of an OpenAI streaming chat request that asks for the final usage chunk.

    Without ``stream_options.include_usage`` the stream carries no usage and the call could
    only be settled at its reservation. None when no change is needed.
    """
    endpoint = path.split("?", 1)[0].rstrip("/")
    if dialect != "openai" or not endpoint.endswith("/completions") or not wants_stream(request):
        return None
    options = request.get("stream_options")
    options = options if isinstance(options, dict) else {}
    if options.get("include_usage") is True:
        return None
    return {**request, "stream_options": {**options, "include_usage": True}}
