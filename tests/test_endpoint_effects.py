"""Effect semantics per endpoint, as data (docs/contract.md §2.2), and the operation id on the wire.

Each endpoint declares ``read_only``, ``at_most_once`` or ``idempotent`` (``billable`` is
the older name); idempotency lives on the endpoint, with the provider's ``[idempotency]``
as the default of its billable endpoints. An endpoint may say where effectguard writes the
call id (``op_id``). The request hash is over the request as the client sent it.
Through AsyncGuardTransport against a respx-mocked upstream.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest
import respx

from effectguard import AsyncGuardTransport
from effectguard.errors import ConfigError
from effectguard.providers import load_providers

TOOL = "http://tool.test"
SEND = TOOL + "/v1/send"
EMAIL = {"to": "ops@example.com", "subject": "hello"}

MakeTransport = Callable[..., AsyncGuardTransport]
Finish = Callable[[AsyncGuardTransport], Awaitable[None]]

BASE = """
name = "tool"
base_url = "http://tool.test"
dialect = "flat"
prices_taken = "2026-12-01"

[models.default]
per_call = "0.01"
max_output_tokens = 0
"""


def declare(tmp_path: Path, text: str) -> Path:
    """A --providers directory holding one ``tool`` declaration (BASE plus ``text``)."""
    folder = tmp_path / "providers"
    folder.mkdir(exist_ok=True)
    (folder / "tool.toml").write_text(BASE + text)
    return folder


def test_billable_means_idempotent_under_a_provider_guarantee_else_at_most_once() -> None:
    """``billable``: idempotent under the provider's [idempotency], else at_most_once."""
    providers = load_providers()
    send = providers["send_email"].effect_for("POST", "/v1/send")
    assert send.effect == "idempotent"
    assert send.idempotency == providers["send_email"].idempotency
    chat = providers["openai"].effect_for("POST", "/v1/chat/completions")
    assert (chat.effect, chat.idempotency) == ("at_most_once", None)
    # An undeclared endpoint is billable with the provider's defaults.
    assert providers["send_email"].effect_for("POST", "/v1/other").effect == "idempotent"


def test_endpoint_idempotency_overrides_and_at_most_once_opts_out(tmp_path: Path) -> None:
    """An endpoint's own guarantee (header or body field) wins; at_most_once drops the default."""
    folder = declare(
        tmp_path,
        """
[idempotency]
header = "Idempotency-Key"
window_seconds = 60

[[endpoints]]
path = "/v1/send"
effect = "at_most_once"

[[endpoints]]
path = "/v1/pay"
effect = "idempotent"
idempotency = { body_field = "meta.idem", window_seconds = 30 }
""",
    )
    tool = load_providers([folder])["tool"]
    assert tool.effect_for("POST", "/v1/send").idempotency is None
    pay = tool.effect_for("POST", "/v1/pay")
    assert pay.effect == "idempotent"
    assert pay.idempotency is not None
    assert (pay.idempotency.body_field, pay.idempotency.window_seconds) == ("meta.idem", 30.0)


@pytest.mark.parametrize(
    ("entry", "field"),
    [
        ('effect = "idempotent"', "endpoints[0].idempotency"),
        (
            'effect = "at_most_once"\nidempotency = { header = "K", window_seconds = 1 }',
            "endpoints[0].idempotency",
        ),
        (
            'effect = "idempotent"\n'
            'idempotency = { header = "K", body_field = "k", window_seconds = 1 }',
            "endpoints[0].idempotency",
        ),
        ('effect = "at_most_once"\nop_id = { cookie = "x" }', "endpoints[0].op_id.cookie"),
        (
            'effect = "at_most_once"\n'
            'lookup = { url = "{base_url}/s/{op}", applied = "id", freshness_s = 1 }',
            "endpoints[0].lookup.op",
        ),
        (
            'effect = "at_most_once"\nop_id = { header = "X-Op" }\n'
            'lookup = { url = "{base_url}/s", applied = "id", freshness_s = 1 }',
            "endpoints[0].lookup.url",
        ),
        (
            'effect = "at_most_once"\nop_id = { header = "X-Op" }\n'
            'lookup = { url = "{base_url}/s/{op}", applied = "id" }',
            "endpoints[0].lookup.freshness_s",
        ),
        ('effect = "read_only"\nop_id = { header = "X-Op" }', "endpoints[0].op_id"),
        (
            # A 200 "not found" with no result collection: any 200 would read not applied.
            'effect = "at_most_once"\nop_id = { header = "X-Op" }\n'
            'lookup = { url = "{base_url}/s/{op}", applied = "id", not_found = [200], '
            "freshness_s = 1 }",
            "endpoints[0].lookup.results",
        ),
        (
            # Form fields are a body: a GET lookup cannot carry them.
            'effect = "at_most_once"\nop_id = { header = "X-Op" }\n'
            'lookup = { url = "{base_url}/s", form = { op = "{op}" }, applied = "id", '
            "freshness_s = 1 }",
            "endpoints[0].lookup.form",
        ),
    ],
)
def test_endpoint_declaration_errors_name_the_field(tmp_path: Path, entry: str, field: str) -> None:
    """A declaration that cannot be honoured is refused at load, naming the field."""
    folder = declare(tmp_path, f'\n[[endpoints]]\npath = "/v1/send"\n{entry}\n')
    with pytest.raises(ConfigError, match=re.escape(f": {field}: ")):
        load_providers([folder])


async def test_at_most_once_endpoint_refuses_a_keyed_resend_of_an_unknown_call(
    tmp_path: Path, make_transport: MakeTransport, finish: Finish
) -> None:
    """The keyed-resend rule reads the endpoint: at_most_once under a provider guarantee → 409."""
    folder = declare(
        tmp_path,
        """
[idempotency]
header = "Idempotency-Key"
window_seconds = 600

[[endpoints]]
path = "/v1/send"
effect = "at_most_once"

[[endpoints]]
path = "/v1/pay"
effect = "billable"
""",
    )
    with respx.mock(base_url=TOOL) as mock:
        send = mock.post("/v1/send").mock(side_effect=[httpx.ReadTimeout("slow")])
        pay = mock.post("/v1/pay").mock(
            side_effect=[httpx.ReadTimeout("slow"), httpx.Response(200, json={"id": "p"})]
        )
        t = make_transport(providers=[folder])
        client = httpx.AsyncClient(transport=t)
        for url in (SEND, TOOL + "/v1/pay"):
            first = await client.post(url, json=EMAIL, headers={"Idempotency-Key": url})
            assert first.status_code == 504
        again = await client.post(SEND, json=EMAIL, headers={"Idempotency-Key": SEND})
        paid = await client.post(
            TOOL + "/v1/pay", json=EMAIL, headers={"Idempotency-Key": TOOL + "/v1/pay"}
        )
        assert again.status_code == 409, again.text
        assert again.json()["error"]["type"] == "effect_unknown"
        assert paid.status_code == 200, paid.text
        assert (send.call_count, pay.call_count) == (1, 2)
        # No provider key went out for the at_most_once endpoint.
        assert "idempotency-key" not in send.calls[0].request.headers
    await finish(t)


async def test_op_id_and_body_field_key_are_written_into_the_request(
    tmp_path: Path, make_transport: MakeTransport, finish: Finish
) -> None:
    """The call id goes where op_id says, the key into its body field; the manifest and the
    request hash are over the body as the client sent it, not as it went upstream."""
    folder = declare(
        tmp_path,
        """
[[endpoints]]
path = "/v1/send"
effect = "idempotent"
idempotency = { body_field = "idem", window_seconds = 600 }
op_id = { json = "metadata.effectguard_op" }

[[endpoints]]
path = "/v1/post"
effect = "at_most_once"
op_id = { header = "X-Effectguard-Op" }
""",
    )
    with respx.mock(base_url=TOOL) as mock:
        send = mock.post("/v1/send").mock(return_value=httpx.Response(200, json={"id": "m"}))
        post = mock.post("/v1/post").mock(return_value=httpx.Response(200, json={"id": "p"}))
        t = make_transport(providers=[folder])
        client = httpx.AsyncClient(transport=t)
        body = {**EMAIL, "metadata": {"mine": "kept"}}
        first = await client.post(SEND, json=body, headers={"Idempotency-Key": "k1"})
        # The same client request again is answered from the ledger, not sent again.
        replay = await client.post(SEND, json=body, headers={"Idempotency-Key": "k1"})
        posted = await client.post(
            TOOL + "/v1/post", json=EMAIL, headers={"X-Effectguard-Op": "spoofed"}
        )
        assert (first.status_code, replay.status_code, posted.status_code) == (200, 200, 200)
        assert replay.headers["effectguard-replayed"] == "true"
        assert send.call_count == 1
        sent = json.loads(send.calls[0].request.content)
        call_id = first.headers["effectguard-call-id"]
        assert sent == {
            **EMAIL,
            "idem": call_id,  # the provider's key is the call's, not the client's "k1"
            "metadata": {"mine": "kept", "effectguard_op": call_id},
        }
        assert post.calls[0].request.headers.get_list("x-effectguard-op") == [
            posted.headers["effectguard-call-id"]
        ]
        # The manifest keeps the body as the client sent it, and the hash is over that: the
        # body as it went upstream, sent by a client under the same key, is another request.
        events = await t.ledger.events(call_id)
        assert json.loads(events[0].data["body"]) == body
        echoed = await client.post(SEND, json=sent, headers={"Idempotency-Key": "k1"})
        assert echoed.status_code == 422, echoed.text
        assert echoed.json()["error"]["type"] == "idempotency_key_reused"
        # A body with no object where the op id goes is refused before anything is sent.
        bad = await client.post(SEND, json={**EMAIL, "metadata": "text"})
        assert bad.status_code == 400 and "metadata.effectguard_op" in bad.text
        assert send.call_count == 1
    await finish(t)


def test_form_bodies_get_the_op_id_appended_and_json_bodies_nested() -> None:
    """The writer appends a form field as the form spells it, and nests a JSON field path."""
    from effectguard.callpath import opfields

    form = opfields.write(b"amount=5", opfields.FORM, [("metadata[effectguard_op]", "c1")])
    assert form == b"amount=5&metadata%5Beffectguard_op%5D=c1"
    nested = opfields.write(b'{"a":{"b":1}}', "application/json", [("a.op", "c1")])
    assert json.loads(nested) == {"a": {"b": 1, "op": "c1"}}
