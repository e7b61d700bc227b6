"""An upstream that keeps connections alive and closes them as real servers do.

It answers every chat request on a raw loopback socket with a small completion, keeps
the connection open, and closes it either once it has been idle ``idle_close_s`` (a
keep-alive timeout: uvicorn's, Node's and Apache's default is 5 s) or ``close_after_s``
after each answer without having said ``Connection: close`` (a server, or a load
balancer in front of one, that hangs up right after answering). It counts the
connections it accepted and keeps the body of every request it read whole (its
receipts): a request it never read is not among them.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time

from edgekit import LoopbackServer, read_request


def chat_answer(content: str) -> bytes:
    """A whole chat completion answer, kept alive (no ``Connection: close``)."""
    body = json.dumps(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "model": "gpt-4o-mini",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        }
    ).encode()
    head = f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len(body)}"
    return head.encode() + b"\r\n\r\n" + body


class KeepAliveUpstream(LoopbackServer):
    """The upstream; a context manager that serves while it is entered."""

    def __init__(self, *, idle_close_s: float = 60.0, close_after_s: float | None = None):
        self.idle_close_s = idle_close_s
        self.close_after_s = close_after_s
        self.connections = 0
        self.receipts: list[bytes] = []
        self._lock = threading.Lock()
        super().__init__()

    def accepted(self, conn: socket.socket) -> None:
        with self._lock:
            self.connections += 1
        threading.Thread(target=self._serve_one, args=(conn,), daemon=True).start()

    def _serve_one(self, conn: socket.socket) -> None:
        with conn:
            while True:
                # Idle between requests: closed, unread, once the keep-alive timeout passes.
                ready, _, _ = select.select([conn], [], [], self.idle_close_s)
                if not ready:
                    return
                request = read_request(conn)
                if request is None:
                    return
                with self._lock:
                    self.receipts.append(request.body)
                try:
                    conn.sendall(chat_answer(json.loads(request.body)["messages"][0]["content"]))
                except OSError:
                    return
                if self.close_after_s is not None:
                    time.sleep(self.close_after_s)
                    return
