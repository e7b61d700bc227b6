"""What hostile input costs the event loop: ``python -m effectguard_bench.edges``.

The proxy parses a request body and reads an upstream's stream on its event loop, so
their cost on absurd input is time every other client waits. This prints, in wall time of
this process (best of ``--repeat``):

- a 10 MiB-class JSON body of a million tiny objects through the body parser (parse,
  repeated-key check, depth check), and an ordinary 10 KB chat body beside it;
- one endless server-sent-event line of ``--line-mib`` MiB fed in 16 KiB chunks to the
  stream reader, and an ordinary 300-chunk chat stream beside it.

Run it with another tree first on ``PYTHONPATH`` for a before/after pair
(docs/performance.md, "Hostile input on the event loop").
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from effectguard.callpath.prepare import _parse_json
from effectguard.rules.streamusage import StreamUsage

_DELTA = (
    b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,'
    b'"delta":{"content":"word "},"finish_reason":null}],"usage":null}\n\n'
)
_LAST = b'data: {"choices":[],"usage":{"prompt_tokens":19,"completion_tokens":300}}\n\n'


def _best(work: Callable[[], object], repeat: int, number: int = 1) -> float:
    """The best of ``repeat`` timings of ``number`` runs of ``work``, per run, in seconds."""
    runs = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            work()
        runs.append((time.perf_counter() - start) / number)
    return min(runs)


def tiny_objects(count: int) -> bytes:
    """A chat body whose ``metadata`` is ``count`` one-key objects."""
    items = b",".join([b'{"a":1}'] * count)
    return b'{"model":"gpt-4o-mini","messages":[],"metadata":[' + items + b"]}"


def chat_body() -> bytes:
    """An ordinary 10 KB chat completion request body."""
    message = b'{"role":"user","content":"' + b"hello world " * 40 + b'"}'
    return (
        b'{"model":"gpt-4o-mini","max_tokens":256,"messages":[' + b",".join([message] * 20) + b"]}"
    )


def feed_line(mib: int) -> None:
    """One ``mib`` MiB line in 16 KiB chunks, then a usage event and the terminal one."""
    reader = StreamUsage("openai", "/v1/chat/completions")
    chunk = b"x" * (16 << 10)
    reader.feed(b'data: {"x": "')
    for _ in range((mib << 20) // len(chunk)):
        reader.feed(chunk)
    reader.feed(b'"}\n\n' + _LAST + b"data: [DONE]\n\n")
    assert reader.finished


def feed_chat_stream() -> None:
    """An ordinary 300-chunk chat stream, a chunk an event."""
    reader = StreamUsage("openai", "/v1/chat/completions")
    for chunk in [_DELTA] * 300 + [_LAST + b"data: [DONE]\n\n"]:
        reader.feed(chunk)
    assert reader.finished


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m effectguard_bench.edges")
    parser.add_argument("--objects", type=int, default=1_400_000, help="tiny objects (1.4M)")
    parser.add_argument("--line-mib", type=int, default=16, help="the endless line's MiB")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    hostile, ordinary = tiny_objects(args.objects), chat_body()
    print(
        f"body of {args.objects} tiny objects ({len(hostile) / 2**20:.1f} MiB): "
        f"{_best(lambda: _parse_json(hostile), args.repeat):.3f} s"
    )
    print(
        f"ordinary {len(ordinary)} B chat body: "
        f"{_best(lambda: _parse_json(ordinary), args.repeat, 2000) * 1e6:.1f} us"
    )
    print(
        f"one {args.line_mib} MiB stream line in 16 KiB chunks: "
        f"{_best(lambda: feed_line(args.line_mib), args.repeat):.3f} s"
    )
    print(
        f"ordinary 300-chunk chat stream: {_best(feed_chat_stream, args.repeat, 200) * 1e6:.0f} us"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
