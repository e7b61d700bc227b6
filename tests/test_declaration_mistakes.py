"""A user's own tool declaration with mistakes in it: each is refused when it is loaded,
naming the file and the field, never found out on the first unknown call.

The declaration is an email API's, as a user would write it (docs/contract.md §2): a send
endpoint, with or without an idempotency guarantee, and a lookup by operation id. Each
mistake below was accepted before, and each would have changed what effectguard does with
a call whose effect is unknown: a lookup that can never find the call reads "not found" and
the email is sent again; a NaN freshness makes a "not found" from a lagging search prove
"not applied" at once; a window in milliseconds has effectguard resend long after the
provider forgot the key.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from stagedkit import serve_refusing

from effectguard.errors import ConfigError
from effectguard.providers import load_providers

MAILER = """
name = "mailer"
base_url = "https://mail.example.com/api"
dialect = "flat"
api_key_env = "MAILER_API_KEY"
key_format = "Bearer {{key}}"
prices_taken = "2026-12-01"
not_processed = [400, 429]
retry_statuses = [429]

[[endpoints]]
path = "/v1/messages/send"
effect = "{effect}"
{idempotency}
op_id = {{ json = "metadata.effectguard_op" }}

[endpoints.lookup]
url = "{url}"
query = {{ {query} }}
applied = "data[0]"
results = "data"
not_found = [200]
freshness_s = {freshness}
timeout_s = {timeout}

[models.default]
per_call = "{price}"
max_output_tokens = 0
"""

GOOD = {
    "effect": "at_most_once",
    "idempotency": "",
    "url": "{base_url}/v1/messages/search",
    "query": 'op = "{op}"',
    "freshness": "60",
    "timeout": "5",
    "price": "0.001",
}
IDEMPOTENT = {
    "effect": "idempotent",
    "idempotency": 'idempotency = { header = "Idempotency-Key", window_seconds = 86400 }',
}


def declare(tmp_path: Path, **fields: str) -> Path:
    """A --providers directory holding mailer.toml: GOOD with ``fields`` changed."""
    folder = tmp_path / "providers"
    folder.mkdir(exist_ok=True)
    values = {**GOOD, **fields}
    (folder / "mailer.toml").write_text(MAILER.format(**values))
    return folder


def refused(tmp_path: Path, field: str, why: str, **fields: str) -> None:
    folder = declare(tmp_path, **fields)
    with pytest.raises(ConfigError) as caught:
        load_providers([folder])
    message = str(caught.value)
    assert message.startswith(f"{folder / 'mailer.toml'}: endpoints[0].{field}: "), message
    assert re.search(why, message), message


@pytest.mark.parametrize("idempotent", [False, True])
def test_the_email_declaration_as_written_loads(tmp_path: Path, idempotent: bool) -> None:
    """The well-formed declaration, with and without an idempotency guarantee, loads."""
    mailer = load_providers([declare(tmp_path, **(IDEMPOTENT if idempotent else {}))])["mailer"]
    send = mailer.effect_for("POST", "/v1/messages/send")
    assert send.effect == ("idempotent" if idempotent else "at_most_once")
    assert send.lookup is not None and send.lookup.freshness_s == 60


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("freshness_s", "nan"),
        ("freshness_s", "inf"),
        ("timeout_s", "nan"),
        ("timeout_s", "inf"),
        ("timeout_s", "0"),
        ("timeout_s", "1e12"),
    ],
)
def test_lookup_seconds_that_are_no_durations_are_refused(
    tmp_path: Path, field: str, value: str
) -> None:
    """A NaN freshness compared "age < freshness" false for every age: a "not found" from a
    search that had not caught up yet proved "not applied", and the email was sent again.
    An infinite, zero or absurd timeout left every lookup hanging, or failing unasked."""
    key = "freshness" if field == "freshness_s" else "timeout"
    refused(tmp_path, f"lookup.{field}", "seconds", **{key: value})


@pytest.mark.parametrize(
    ("window", "why"),
    [
        ("inf", "finite"),
        ("nan", "> 0"),
        ("86400000", "milliseconds"),  # 24 h written in ms: 1000 days
        ("1000000000000", "milliseconds"),
    ],
)
def test_an_idempotency_window_past_any_providers_is_refused(
    tmp_path: Path, window: str, why: str
) -> None:
    """Inside the window effectguard resends an unknown call under the provider key; past
    the provider's real window the provider has forgotten the key, and the resend is a
    second email. A window of 1000 days or more (24 h written in milliseconds) was taken."""
    idempotency = IDEMPOTENT["idempotency"].replace("86400", window)
    refused(
        tmp_path,
        "idempotency.window_seconds",
        why,
        effect="idempotent",
        idempotency=idempotency,
    )


@pytest.mark.parametrize(
    ("url", "query", "where", "why"),
    [
        # An escaped brace is a literal "{op}": every lookup asked for the same string,
        # found nothing, and "not found" decided every unknown send "not applied".
        ("{base_url}/v1/messages/{{op}}", "", "url", r"\{op\}"),
        ("{base_url}/v1/messages/search", 'op = "{{op}}"', "url", r"\{op\}"),
        # The query value formatted with op alone raised KeyError at the first lookup.
        (
            "{base_url}/v1/messages/search",
            'op = "{op}", back = "{base_url}"',
            "query",
            r"only \{op\}",
        ),
        # The provider's credential sent to another host, or outside the base path.
        ("{base_url}.evil.example/search", 'op = "{op}"', "url", "base_url"),
        ("{base_url}@evil.example/search", 'op = "{op}"', "url", "base_url"),
        ("{base_url}:8443/search", 'op = "{op}"', "url", "base_url"),
        ("{base_url}/../../admin/search", 'op = "{op}"', "url", r"\.\."),
        ("{base_url}/v1/%2e%2e/search", 'op = "{op}"', "url", r"\.\."),
        ("{base_url}/v1/{op!r}", "", "url", r"\{op\}"),
        ("{base_url}/v1/{op:>40}", "", "url", r"\{op\}"),
    ],
)
def test_a_lookup_that_could_never_find_the_call_is_refused(
    tmp_path: Path, url: str, query: str, where: str, why: str
) -> None:
    """The lookup template must carry the operation id and stay under the base URL."""
    refused(tmp_path, f"lookup.{where}", why, url=url, query=query)


def test_key_format_with_an_escaped_or_unknown_field_is_refused(tmp_path: Path) -> None:
    """``{{key}}`` passed the check that the format contains ``{key}`` and sent the literal
    text as the credential; ``{key} {x}`` raised KeyError on the first request."""
    for bad in ("Bearer {{key}}", "Bearer {key} {x}", "Bearer {key!r}"):
        folder = declare(tmp_path)
        path = folder / "mailer.toml"
        text = path.read_text().replace('"Bearer {key}"', f'"{bad}"')
        path.write_text(text)
        with pytest.raises(ConfigError, match=re.escape(f"{path}: key_format: ")):
            load_providers([folder])


@pytest.mark.parametrize("price", ["10000000", "1e30"])
def test_a_price_no_call_could_ever_be_admitted_at_is_refused(tmp_path: Path, price: str) -> None:
    """A per-call price above the most one call may reserve (2^53 nano-dollars, about
    9 million USD) was loaded, and then every call was refused 400 one by one."""
    folder = declare(tmp_path, price=price)
    with pytest.raises(ConfigError, match=re.escape("models.default.per_call: ")):
        load_providers([folder])


def test_a_literal_endpoint_wins_over_a_parameter_declared_before_it(tmp_path: Path) -> None:
    """``POST /v1/messages/{id}`` read_only declared before ``POST /v1/messages/send``
    made the send read_only: passed through unrecorded, never guarded. The most specific
    declaration matches, whatever the order, in a file and through ``extends``."""
    folder = declare(tmp_path)
    path = folder / "mailer.toml"
    shadow = '[[endpoints]]\npath = "/v1/messages/{id}"\neffect = "read_only"\n\n'
    text = path.read_text()
    path.write_text(text.replace("[[endpoints]]", shadow + "[[endpoints]]", 1))
    mailer = load_providers([folder])["mailer"]
    assert mailer.effect_for("POST", "/v1/messages/send").effect == "at_most_once"
    assert mailer.effect_for("POST", "/v1/messages/m_1").effect == "read_only"
    # An override adding a parameter path after the bundled literal ones.
    more = tmp_path / "more"
    more.mkdir()
    (more / "stripe.toml").write_text(
        'extends = "stripe"\n[[endpoints]]\npath = "/v1/customers/{customer}"\n'
        'method = "GET"\neffect = "read_only"\n'
        '[[endpoints]]\npath = "/v1/{resource}/search"\nmethod = "GET"\n'
        'effect = "at_most_once"\n'
    )
    stripe = load_providers([more])["stripe"]
    assert stripe.effect_for("GET", "/v1/customers/search").effect == "read_only"
    assert stripe.effect_for("GET", "/v1/things/search").effect == "at_most_once"


def test_serve_refuses_the_mistake_in_one_line(tmp_path: Path) -> None:
    """Through the command line: exit 2 and one line naming the file and the field."""
    folder = declare(tmp_path, freshness="nan")
    done = serve_refusing("--providers", str(folder), "--ledger", "l.db", cwd=tmp_path)
    assert done.code == 2, done
    assert "mailer.toml: endpoints[0].lookup.freshness_s" in done.err, done
    assert done.err.count("\n") == 1
