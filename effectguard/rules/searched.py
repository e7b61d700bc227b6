"""Whether a lookup searched where a call's operation went. Pure.

A lookup's "not found" proves "not applied" only of an operation the provider was given
(docs/contract.md §2.2), and only if the search looked where it was given: the same
provider (the base URL the attempts were sent to: serve's ``--upstream`` may send a
provider elsewhere than its declaration, and ``reconcile --auto`` runs in a process of its
own) and the same account (the credential the attempts carried: a client's own key, or a
key since replaced, names an account this lookup may not search). A search anywhere else
finds nothing whether the operation happened or not. Each attempt records how it went out
(:class:`~effectguard.rules.admission.Sending`); an attempt that recorded less (an older
release's) leaves "not found" proving nothing, as one that did not carry the operation id.
"""

from __future__ import annotations

from collections.abc import Collection

from effectguard.rules.admission import Sending

__all__ = ["blind_spot"]


def blind_spot(
    attempts: Collection[Sending],
    *,
    op_id_in: str | None,
    by_key: bool,
    base_url: str,
    key_digest: str | None,
) -> str | None:
    """Why this lookup's "not found" cannot prove the call "not applied" (None: it can).

    ``attempts``: how each attempt of the call went out; ``op_id_in``: where the endpoint
    writes the operation id the lookup searches for (None: it writes none); ``by_key``:
    the lookup searches for the provider idempotency key the attempts recorded instead;
    ``base_url`` and ``key_digest``: where, and with which credential, it asks.
    """
    if not attempts:
        return "no attempt of the call is recorded"
    if not by_key and (op_id_in is None or any(a.op_id_in != op_id_in for a in attempts)):
        return "not every attempt of the call is recorded as carrying the operation id searched for"
    elsewhere = sorted({a.sent_to or "(not recorded)" for a in attempts if a.sent_to != base_url})
    if elsewhere:
        return (
            f"this lookup asks {base_url}, and not every attempt of the call is recorded as "
            f"sent there (sent to: {', '.join(elsewhere)})"
        )
    if any(a.key_digest != key_digest for a in attempts):
        return (
            "this lookup asks with another credential than an attempt of the call carried "
            "(another account's operations, or a key since replaced)"
        )
    return None
