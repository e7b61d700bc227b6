"""Provider declarations: the bundled files, overrides, extensions and validation errors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from stagedkit import serve_refusing

import effectguard
from effectguard.errors import ConfigError
from effectguard.providers import (
    Endpoint,
    IdempotencyGuarantee,
    ModelPrice,
    bundled_dir,
    load_provider,
    load_providers,
)
from effectguard.rules.money import usd_to_nanos

MINIMAL = """
base_url = "https://tool.example.com"
dialect = "flat"
prices_taken = "2026-11-29"
not_processed = [400, 429]
retry_statuses = [429]

[[endpoints]]
path = "/v1/run"
effect = "billable"

[models.default]
per_call = "0.01"
"""


def write(directory: Path, name: str, text: str) -> Path:
    """Write a TOML file into ``directory`` and return its path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.toml"
    path.write_text(text)
    return path


def test_bundled_declarations_are_package_data() -> None:
    """The bundled declarations are package data, so an installed wheel has them too."""
    names = {p.name for p in bundled_dir().iterdir()}
    assert names >= {"openai.toml", "anthropic.toml", "send_email.toml"}
    assert set(load_providers()) >= {"openai", "anthropic", "send_email"}


def test_bundled_openai() -> None:
    """OpenAI is declared with its endpoints, prices as exact nanos and no idempotency."""
    openai = load_providers()["openai"]
    assert openai.base_url == "https://api.openai.com"
    assert openai.dialect == "openai"
    assert openai.api_key_env == "OPENAI_API_KEY"
    assert (openai.key_header, openai.key_format) == ("authorization", "Bearer {key}")
    assert openai.idempotency is None and openai.lookup is None
    assert openai.retry_statuses == {429} <= openai.not_processed
    assert openai.prices_taken == "2026-11-29"
    assert openai.source.endswith("openai.toml")
    mini = openai.models["gpt-4o-mini"]
    assert mini == ModelPrice(
        input=usd_to_nanos("0.15"),
        output=usd_to_nanos("0.60"),
        cached_input=usd_to_nanos("0.075"),
        max_output_tokens=16384,
        web_search=usd_to_nanos("0.025"),  # the Responses API's web search, per call
    )
    for model in (
        "gpt-4o",
        "gpt-4.1",
        "gpt-4.1-mini",
        "gpt-4.1-nano",
        "o4-mini",
        "o3",
        "text-embedding-3-small",
        "text-embedding-3-large",
    ):
        assert model in openai.models
    assert openai.models["text-embedding-3-small"].output == 0


def test_bundled_transient_statuses_say_what_each_means_for_the_effect() -> None:
    """OpenAI and Anthropic declare 500 effect-unknown and their overload statuses no-effect."""
    providers = load_providers()
    openai, anthropic = providers["openai"], providers["anthropic"]
    assert dict(openai.transient) == {500: "unknown", 503: "none"}
    assert [openai.answer_effect(s) for s in (200, 429, 500, 502, 503)] == [
        "applied",
        "none",
        "unknown",
        "applied",
        "none",
    ]
    assert [anthropic.answer_effect(s) for s in (500, 529)] == ["unknown", "none"]
    assert anthropic.no_effect_statuses == {400, 401, 403, 404, 413, 429, 529}
    assert openai.no_effect_statuses == {400, 401, 403, 404, 422, 429, 503}


def test_bundled_anthropic() -> None:
    """Anthropic uses x-api-key, retries 429 and 529, and prices cache reads and writes."""
    anthropic = load_providers()["anthropic"]
    assert (anthropic.key_header, anthropic.key_format) == ("x-api-key", "{key}")
    assert anthropic.api_key_env == "ANTHROPIC_API_KEY"
    assert anthropic.not_processed == {400, 401, 403, 404, 413, 429}
    assert dict(anthropic.transient) == {500: "unknown", 529: "none"}
    assert anthropic.answer_effect(529) == "none"
    assert anthropic.retry_statuses == {429, 529}
    assert anthropic.idempotency is None
    for name in ("claude-sonnet-4-5", "claude-haiku-4-5", "claude-opus-4-5"):
        price = anthropic.models[name]
        assert price.cache_write is not None and price.cached_input is not None
        assert price.cache_write * 4 == price.input * 5  # the 5-minute write is 1.25x input
    assert anthropic.endpoint_for("POST", "/v1/messages") == Endpoint(
        "/v1/messages", "at_most_once"
    )
    count = anthropic.endpoint_for("POST", "/v1/messages/count_tokens")
    assert count is not None and count.effect == "read_only"


def test_bundled_send_email_is_flat_and_idempotent() -> None:
    """The tool example is per-call priced, declares idempotency and a lookup path."""
    tool = load_providers()["send_email"]
    assert tool.dialect == "flat"
    assert tool.idempotency == IdempotencyGuarantee("Idempotency-Key", 86400.0)
    assert tool.lookup == "{base_url}/ops/{key}"
    assert tool.price_for(None) == ModelPrice(0, 0, max_output_tokens=0, per_call=1_000_000)


def test_endpoint_for_matches_method_path_and_params() -> None:
    """Endpoints match by method and exact path; {param} matches one segment; unknown is None."""
    openai = load_providers()["openai"]
    assert openai.endpoint_for("post", "/v1/chat/completions") is not None
    models = openai.endpoint_for("GET", "/v1/models/gpt-4o")
    assert models is not None and models.effect == "read_only"
    assert openai.endpoint_for("GET", "/v1/models/a/b") is None
    assert openai.endpoint_for("GET", "/v1/models/") is None
    assert openai.endpoint_for("PUT", "/v1/chat/completions") is None
    assert openai.endpoint_for("POST", "/v1/chat/completions/x/y") is None


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("gpt-4o-mini", "gpt-4o-mini"),
        ("gpt-4o-mini-2024-07-18", "gpt-4o-mini"),
        ("gpt-4o-2024-08-06", "gpt-4o"),
        ("gpt-4.1-nano-2025-04-14", "gpt-4.1-nano"),
        ("o3-2025-04-16", "o3"),
        ("gpt-4o-audio-preview", None),
        ("o3-mini", None),
        ("gpt-4o-", None),
        ("unknown", None),
        (None, None),
    ],
)
def test_price_for_dated_snapshots(model: str | None, expected: str | None) -> None:
    """A dated snapshot is priced as its longest declared base; other unknown models are not."""
    openai = load_providers()["openai"]
    want = None if expected is None else openai.models[expected]
    assert openai.price_for(model) == want


def test_price_for_anthropic_snapshot_prefers_longest() -> None:
    """claude-sonnet-4-5-20250929 is priced as claude-sonnet-4-5, not claude-sonnet-4."""
    anthropic = load_providers()["anthropic"]
    sonnet45 = anthropic.price_for("claude-sonnet-4-5-20250929")
    assert sonnet45 is anthropic.models["claude-sonnet-4-5"]
    assert anthropic.price_for("claude-sonnet-4-20250514") is anthropic.models["claude-sonnet-4"]
    assert anthropic.price_for("claude-3-5-haiku-latest") is anthropic.models["claude-3-5-haiku"]


def test_snapshot_never_falls_back_to_a_shorter_family(tmp_path: Path) -> None:
    """Without gpt-4o-mini declared, gpt-4o-mini-2024-07-18 is unpriced rather than gpt-4o."""
    text = MINIMAL.replace('dialect = "flat"', 'dialect = "openai"')
    text += '[models."gpt-4o"]\ninput = "2.5"\noutput = "10"\n'
    provider = load_provider(write(tmp_path, "p", text))
    assert provider.price_for("gpt-4o-mini-2024-07-18") is None
    assert provider.price_for(None) is None  # only flat providers price "no model"


def test_providers_dir_adds_and_replaces(tmp_path: Path) -> None:
    """A --providers file adds a provider, and one with a bundled name replaces it whole."""
    write(tmp_path, "mytool", MINIMAL)
    write(tmp_path, "other", MINIMAL.replace("dialect", 'name = "openai"\ndialect'))
    providers = load_providers([tmp_path])
    assert providers["mytool"].name == "mytool"  # the name defaults to the file stem
    assert providers["openai"].dialect == "flat"
    assert "gpt-4o" not in providers["openai"].models
    assert providers["openai"].source == str(tmp_path / "other.toml")
    assert "anthropic" in providers


def test_extends_merges_models_and_overrides_fields(tmp_path: Path) -> None:
    """extends adds models, changes single prices field by field and replaces scalar fields."""
    write(
        tmp_path,
        "local-openai",
        """
extends = "openai"
base_url = "http://localhost:11434/"
retry_statuses = [429, 400]

[models."llama3"]
input = "0"
output = "0"

[models."gpt-4o"]
output = "12.00"
""",
    )
    bundled = load_providers()["openai"]
    openai = load_providers([tmp_path])["openai"]
    assert "local-openai" not in load_providers([tmp_path])
    assert openai.base_url == "http://localhost:11434"
    assert openai.retry_statuses == {400, 429}
    assert openai.models["llama3"] == ModelPrice(0, 0)
    assert openai.models["gpt-4o"].output == usd_to_nanos("12.00")
    assert openai.models["gpt-4o"].input == bundled.models["gpt-4o"].input
    assert openai.models["gpt-4o-mini"] == bundled.models["gpt-4o-mini"]
    assert openai.endpoints == bundled.endpoints
    assert openai.source == str(tmp_path / "local-openai.toml")


def test_extends_with_new_name_derives_a_provider(tmp_path: Path) -> None:
    """An extension with its own name is a new provider built on the base; the base stays."""
    write(
        tmp_path,
        "azure",
        """
extends = "openai"
name = "azure"
base_url = "https://example.openai.azure.com"

[[endpoints]]
path = "/v1/batches/{id}"
method = "GET"
effect = "read_only"
""",
    )
    providers = load_providers([tmp_path])
    assert providers["openai"].base_url == "https://api.openai.com"
    azure = providers["azure"]
    assert azure.models == providers["openai"].models
    assert azure.endpoint_for("GET", "/v1/batches/b_1") is not None
    assert azure.endpoint_for("POST", "/v1/chat/completions") is not None


def test_extends_a_provider_of_the_same_directory(tmp_path: Path) -> None:
    """Within a directory, plain declarations load before extensions, whatever the file order."""
    write(tmp_path, "a-ext", 'extends = "zz"\nbase_url = "https://changed.example.com"\n')
    write(tmp_path, "zz", MINIMAL)
    assert load_providers([tmp_path])["zz"].base_url == "https://changed.example.com"


def test_extends_unknown_provider(tmp_path: Path) -> None:
    """Extending a provider that is not loaded is an error naming the file and field."""
    path = write(tmp_path, "x", 'extends = "nope"\n')
    with pytest.raises(ConfigError, match=re.escape(f"{path}: extends:")):
        load_providers([tmp_path])


def test_load_provider_refuses_extends(tmp_path: Path) -> None:
    """A standalone load cannot resolve extends and says so."""
    path = write(tmp_path, "x", 'extends = "openai"\n')
    with pytest.raises(ConfigError, match=re.escape(f"{path}: extends:")):
        load_provider(path)


def test_duplicate_name_in_one_directory(tmp_path: Path) -> None:
    """Two files of one directory declaring the same provider is an error."""
    write(tmp_path, "a", MINIMAL.replace("dialect", 'name = "dup"\ndialect'))
    write(tmp_path, "b", MINIMAL.replace("dialect", 'name = "dup"\ndialect'))
    with pytest.raises(ConfigError, match="name: 'dup' also declared"):
        load_providers([tmp_path])


def test_missing_providers_dir(tmp_path: Path) -> None:
    """A --providers directory that does not exist is an error naming it."""
    with pytest.raises(ConfigError, match="not a directory"):
        load_providers([tmp_path / "nope"])


def test_upstream_overrides_base_url() -> None:
    """--upstream NAME=URL replaces the base URL (trailing slash dropped), nothing else."""
    providers = load_providers(upstreams={"openai": "http://127.0.0.1:9000/"})
    assert providers["openai"].base_url == "http://127.0.0.1:9000"
    assert providers["openai"].models == load_providers()["openai"].models


@pytest.mark.parametrize(
    ("upstreams", "message"),
    [
        ({"nope": "http://x"}, "upstreams={'nope': ...}: unknown provider"),
        ({"openai": "ftp://x"}, "upstreams={'openai': ...}: must be an http(s) URL"),
        ({"openai": "localhost:8000"}, "upstreams={'openai': ...}: must be an http(s) URL"),
    ],
)
def test_upstream_errors(upstreams: dict[str, str], message: str) -> None:
    """An unknown provider or a non-http(s) URL in ``upstreams`` is refused, naming the
    library's argument (the CLI names its own flag)."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_providers(upstreams=upstreams)


@pytest.mark.parametrize(
    ("old", "new", "field"),
    [
        ('per_call = "0.01"', "per_call = 0.01", "models.default.per_call"),
        ('per_call = "0.01"', 'per_call = "abc"', "models.default.per_call"),
        ('per_call = "0.01"', 'per_call = "-1"', "models.default.per_call"),
        (
            'per_call = "0.01"',
            'per_call = "0.01"\ncached_inptu = "1"',
            "models.default.cached_inptu",
        ),
        ('per_call = "0.01"', 'input = "1"', "models.default.output"),
        (
            'per_call = "0.01"',
            'per_call = "1"\nmax_output_tokens = -1',
            "models.default.max_output_tokens",
        ),
        ('dialect = "flat"', 'dialect = "grpc"', "dialect"),
        ('dialect = "flat"', "", "dialect"),
        ('base_url = "https://tool.example.com"', 'base_url = "tool.example.com"', "base_url"),
        ('base_url = "https://tool.example.com"', 'base_url = "https://x?a=1"', "base_url"),
        ('effect = "billable"', 'effect = "maybe"', "endpoints[0].effect"),
        ('effect = "billable"', 'effect = "billable"\nunits = []', "endpoints[0].units"),
        (
            'effect = "billable"',
            'effect = "billable"\nunits = { fields = [] }',
            "endpoints[0].units.fields",
        ),
        (
            'effect = "billable"',
            'effect = "billable"\nunits = { fields = ["To"], separator = "" }',
            "endpoints[0].units.separator",
        ),
        (
            'effect = "billable"',
            'effect = "billable"\nunits = { fields = ["To"], items = 5 }',
            "endpoints[0].units.items",
        ),
        (
            'effect = "billable"',
            'effect = "read_only"\nunits = { fields = ["To"] }',
            "endpoints[0].units",
        ),
        ('path = "/v1/run"', 'path = "v1/run"', "endpoints[0].path"),
        ("not_processed = [400, 429]", "not_processed = [400, 700]", "not_processed"),
        ("not_processed = [400, 429]", 'not_processed = ["429"]', "not_processed"),
        ("retry_statuses = [429]", "retry_statuses = [429, 503]", "retry_statuses"),
        ('dialect = "flat"', 'dialect = "flat"\n[transient]\n500 = "maybe"', "transient.500"),
        ('dialect = "flat"', 'dialect = "flat"\n[transient]\n700 = "none"', "transient.700"),
        ('dialect = "flat"', 'dialect = "flat"\n[transient]\nfive = "none"', "transient.five"),
        ('dialect = "flat"', 'dialect = "flat"\ntransient = [500]', "transient"),
        # A status has one meaning: not processed, or transient.
        ('dialect = "flat"', 'dialect = "flat"\n[transient]\n429 = "none"', "transient.429"),
        # Only an answer that proves nothing happened may be retried automatically.
        (
            "retry_statuses = [429]",
            'retry_statuses = [429, 500]\n[transient]\n500 = "unknown"',
            "retry_statuses",
        ),
        ('prices_taken = "2026-11-29"', 'prices_taken = "last week"', "prices_taken"),
        ('prices_taken = "2026-11-29"', "", "prices_taken"),
        ('dialect = "flat"', 'dialect = "flat"\napi_key_env = "sk-abc123"', "api_key_env"),
        ('dialect = "flat"', 'dialect = "flat"\nkey_format = "Bearer"', "key_format"),
        ('dialect = "flat"', 'dialect = "flat"\nlookup = "{base_url}/ops"', "lookup"),
        ('dialect = "flat"', 'dialect = "flat"\nlookup = "{host}/{key}"', "lookup"),
        ('dialect = "flat"', 'dialect = "flat"\nbase_ulr = "x"', "base_ulr"),
        ('dialect = "flat"', 'dialect = "flat"\nname = "Bad Name"', "name"),
        (
            'dialect = "flat"',
            'dialect = "flat"\n[idempotency]\nheader = "Idempotency-Key"\nwindow_seconds = 0',
            "idempotency.window_seconds",
        ),
        (
            'dialect = "flat"',
            'dialect = "flat"\n[idempotency]\nheader = "bad header"\nwindow_seconds = 60',
            "idempotency.header",
        ),
    ],
)
def test_validation_errors_name_file_and_field(
    tmp_path: Path, old: str, new: str, field: str
) -> None:
    """Every invalid declaration raises ConfigError naming the file and the offending field."""
    assert old in MINIMAL
    text = MINIMAL.replace(old, new)
    if new.startswith('dialect = "flat"\n['):  # a table must come after the top-level keys
        text = MINIMAL.replace(old, 'dialect = "flat"') + new.removeprefix('dialect = "flat"')
    path = write(tmp_path, "bad", text)
    with pytest.raises(ConfigError, match=re.escape(f"{path}: {field}")):
        load_provider(path)


def test_float_price_message_explains_why(tmp_path: Path) -> None:
    """A TOML float price is refused with a message that says floats are not exact."""
    path = write(tmp_path, "bad", MINIMAL.replace('"0.01"', "0.01"))
    with pytest.raises(ConfigError, match=r"decimal USD string.*not exact"):
        load_provider(path)


def test_invalid_toml_names_file(tmp_path: Path) -> None:
    """A file that is not TOML is an error naming the file."""
    path = write(tmp_path, "bad", "name = \n")
    with pytest.raises(ConfigError, match=re.escape(f"{path}: not valid TOML")):
        load_provider(path)


def test_a_declaration_that_is_not_utf8_is_refused_naming_it(tmp_path: Path) -> None:
    """serve --providers DIR holding a file that is not UTF-8 exits 2 with one line naming
    the file (it was a UnicodeDecodeError traceback), before any ledger is made."""
    declarations = tmp_path / "providers"
    declarations.mkdir()
    (declarations / "latin.toml").write_bytes(b'name = "caf\xe9"\n')
    done = serve_refusing("--providers", str(declarations), "--ledger", "l.db", cwd=tmp_path)
    assert done.code == 2, done
    assert done.err.startswith(f"effectguard: {declarations / 'latin.toml'}: not UTF-8"), done
    assert done.err.count("\n") == 1
    assert not (tmp_path / "l.db").exists()


def test_duplicate_endpoint(tmp_path: Path) -> None:
    """The same method and path declared twice is an error."""
    again = '[[endpoints]]\npath = "/v1/run"\neffect = "read_only"\n\n'
    text = MINIMAL.replace("[models.default]", again + "[models.default]")
    path = write(tmp_path, "dup", text)
    with pytest.raises(ConfigError, match=re.escape(f"{path}: endpoints[1].path")):
        load_provider(path)


def test_integer_price_and_native_date_accepted(tmp_path: Path) -> None:
    """Integer USD prices are exact and a TOML date is accepted for prices_taken."""
    text = MINIMAL.replace('per_call = "0.01"', "per_call = 2").replace(
        '"2026-11-29"', "2026-11-29"
    )
    provider = load_provider(write(tmp_path, "ok", text))
    assert provider.models["default"].per_call == usd_to_nanos(2)
    assert provider.prices_taken == "2026-11-29"
    assert provider.key_format == "Bearer {key}"  # the default for the authorization header
    assert provider.api_key_env is None


@pytest.mark.parametrize("key", ["\u00b2\u2075\u2070", "9" * 5000, "99", "abc"])
def test_a_transient_status_that_is_no_http_status_is_named(tmp_path: Path, key: str) -> None:
    """A [transient] key that is not a status 100-599 (a superscript, which isdigit() takes
    and int() refuses; 5,000 digits, past int()'s limit) is an error naming it, never a
    traceback."""
    path = write(tmp_path, "x", MINIMAL + f'\n[transient]\n"{key}" = "unknown"\n')
    with pytest.raises(ConfigError, match=re.escape(f"{path}: transient.")):
        load_providers([tmp_path])


@pytest.mark.parametrize("kind", ["str", "Path"])
def test_load_providers_takes_a_plain_path(kind: str) -> None:
    """``effectguard.load_providers(["providers/examples"])`` as a user writes it: a str
    (or Path) directory. A str used to fail with AttributeError ('str' has no is_dir)."""
    where = Path(__file__).parent.parent / "providers" / "examples"
    loaded = effectguard.load_providers([str(where) if kind == "str" else where])
    assert loaded["openai"].price_for("llama-3.1-8b-instruct") is not None


def test_error_shape_defaults_to_the_dialect_and_is_checked(tmp_path: Path) -> None:
    """A declaration may name the shape of effectguard's refusals (docs/contract.md §9);
    without one, an anthropic provider answers in Anthropic's and any other in OpenAI's,
    and the bundled tools name their vendors'."""
    providers = load_providers()
    shapes = {name: providers[name].error_shape for name in ("openai", "anthropic", "stripe")}
    assert shapes == {"openai": "openai", "anthropic": "anthropic", "stripe": "stripe"}
    assert (providers["postmark"].error_shape, providers["github"].error_shape) == (
        "postmark",
        "github",
    )
    assert load_provider(write(tmp_path, "p", MINIMAL)).error_shape == "openai"
    named = load_provider(write(tmp_path, "q", _shaped("postmark")))
    assert named.error_shape == "postmark"
    with pytest.raises(ConfigError, match="error_shape: must be one of openai, anthropic"):
        load_provider(write(tmp_path, "r", _shaped("soap")))


def _shaped(shape: str) -> str:
    return MINIMAL.replace('dialect = "flat"\n', f'dialect = "flat"\nerror_shape = "{shape}"\n')
