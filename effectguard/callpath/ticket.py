"""What the guard tells the caller of a request as soon as it knows it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from effectguard.callpath.exchange import Reply
from effectguard.callpath.orphans import Orphans, RetryKey
from effectguard.callpath.prepare import Prepared
from effectguard.errors import Refusal
from effectguard.telemetry.report import CallReport


@dataclass
class Ticket:
    """What the guard tells the caller of :meth:`Guard.handle` as soon as it knows it.

    ``call_id`` is set once the request is a call (admitted, replayed or joined);
    ``dispatch`` once this request dispatches it. The proxy names the call id in any
    answer it must give on its own (an internal error, the end of a shutdown drain).
    """

    call_id: str | None = None
    dispatch: asyncio.Future[Reply] | None = field(default=None, repr=False)
    #: Set when a shutdown cuts the call off: the refusal its caller is answered (or the
    #: provider's last answer, the call cut off between attempts).
    cut: asyncio.Future[Refusal | Reply] | None = field(default=None, repr=False)
    #: Set when this request is a retry that joined the call (``call_id``) and waits for
    #: it: a shutdown's cut-off answers it as the call ends (``Dispatches.joined_end``).
    joining: Prepared | None = field(default=None, repr=False)
    #: How a key-less request's retry would match it (callpath/orphans); None if keyed.
    retry_key: RetryKey | None = None
    #: With ``report_later`` (the proxy asks for it), the request's report, left for the
    #: caller to hand on once it has written the answer and knows whether the client left
    #: (a guarded stream still reports itself at its end).
    report: CallReport | None = None
    report_later: bool = False
    #: The name of the proxy key the request presented (its access line names it).
    key: str | None = None
    #: The caller's client has gone (the proxy learns it when the connection is lost):
    #: the call's retry is to get its answer, however soon it comes (callpath/orphans).
    left: bool = False
    #: The caller's client closed its sending side after its whole request: waiting for
    #: the answer (a half-close) or gone (a close), the wire does not say. It is admitted
    #: and answered all the same, and its call's retry gets the answer too.
    may_have_left: bool = False

    def admitted(self, call_id: str, orphans: Orphans) -> str:
        """The request is call ``call_id`` (admitted, replayed or joined); if its client
        has left already, or may have, the call's retry is to get its answer."""
        self.call_id = call_id
        if self.left or self.may_have_left:
            orphans.left(self.retry_key, call_id)
        return call_id

    def sending_closed(self, orphans: Orphans) -> None:
        """The client closed its sending side after its whole request: still answered,
        but once the request is a call, its retry gets its answer, as if it had left
        (a timed-out SDK's close looks the same)."""
        self.may_have_left = True
        if self.call_id is not None:
            orphans.left(self.retry_key, self.call_id)

    def leave(self, orphans: Orphans) -> None:
        """The client has gone before its answer was written: once the request is a
        call, the call's retry gets its answer, however soon the retry comes."""
        self.left = True
        if self.call_id is not None:
            orphans.left(self.retry_key, self.call_id)

    def check_client(self) -> None:
        """Refuse a request whose client has gone before it was admitted: nobody would
        read its answer, and its retry may be under way already, admitted as new work
        (the proxy can read requests in another order than their clients sent them)."""
        if self.left:
            raise Refusal(
                400,
                "client_disconnected",
                "the client went away before the call was admitted; nothing was sent",
            )
