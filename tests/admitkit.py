"""An admission request for ledger tests, with the fields the test does not look at filled in.

Most ledger tests admit a plain billable ``POST`` to OpenAI's chat endpoint: the test
names only what it cares about (the budget, the reservation, the key, the hash) and
:func:`admit_request` fills in the rest, the same way for every test.
"""

from __future__ import annotations

from typing import Any

from effectguard.ledger import AdmitRequest


def admit_request(
    budget: str = "team/run",
    *,
    reserve: int = 1_000,
    request_hash: str = "h",
    key: str | None = None,
    model: str | None = "gpt-x",
    body: str = "{}",
    endpoint: str = "/v1/chat/completions",
    budget_root: str | None = None,
    **fields: Any,
) -> AdmitRequest:
    """A billable ``POST`` to OpenAI's ``endpoint`` charged to ``budget`` (its root: the
    path's first segment unless ``budget_root`` is given), with an inline UTF-8 ``body``
    and no stream; ``fields`` sets any other field of :class:`AdmitRequest`."""
    return AdmitRequest(
        request_hash=request_hash,
        provider="openai",
        endpoint=endpoint,
        method="POST",
        model=model,
        idempotency_key=key,
        budget=budget,
        budget_root=budget.split("/")[0] if budget_root is None else budget_root,
        effect_kind="billable",
        body=body,
        body_encoding=fields.pop("body_encoding", "utf8"),
        stream=False,
        reserve=reserve,
        **fields,
    )
