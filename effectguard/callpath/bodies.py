"""Non-JSON request bodies: form-encoded and multipart/form-data. Pure.

A guarded request is hashed canonically, so that two uploads asking for the same thing
hash the same and two that differ never do:

* a form body over its decoded field list, in order (``a=1&b=2`` and ``a=%31&b=2`` are one
  request; ``b=2&a=1`` is another, because a form's order can matter to the server);
* a multipart body over its parts, in order: each part's name, filename and content type
  (the headers that say what the part is) and a SHA-256 digest of its content. The
  boundary and any other part header are framing, not meaning.

The multipart parser is a small, strict boundary parser over the bytes already read
(bounded by ``max_body_bytes``), or over a memory map of the file a large upload was
spooled to (ingress/spool.py): the stdlib's ``cgi`` is gone, and ``email``'s MIME parser
copies every part and accepts malformed framing silently. Part headers are read with
``email``'s header parser, which knows RFC 2231 parameters.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import re
from dataclasses import dataclass
from email.message import Message
from email.parser import BytesHeaderParser
from email.utils import collapse_rfc2231_value
from typing import Any, Literal
from urllib.parse import parse_qsl

from effectguard.callpath.opfields import FORM

__all__ = [
    "MULTIPART",
    "BodyKind",
    "Malformed",
    "Part",
    "hashed_form",
    "hashed_parts",
    "kind_of",
    "parse_form",
    "parse_multipart",
    "parse_multipart_file",
    "part_fields",
]

MULTIPART = "multipart/form-data"
#: What the multipart parser reads: bytes, or a memory map of a spooled upload.
Buffer = bytes | mmap.mmap
BodyKind = Literal["json", "form", "multipart"]
#: More fields or parts than any real API takes: a bound on the work a body can cause.
MAX_FIELDS = 1000
#: A text part (no filename) up to this size is kept as a field (``model``, ``purpose``).
MAX_FIELD_BYTES = 64 * 1024
#: The most a part's header block may take; a real one is two or three lines, a few
#: hundred bytes. Lines cost the header parser most (about 3 µs each), so they are
#: bounded apart: 1000 parts of 32 lines parse in under 0.1 s.
MAX_PART_HEAD_BYTES = 16 * 1024
MAX_PART_HEAD_LINES = 32
_BAD_ESCAPE = re.compile(r"%(?![0-9A-Fa-f]{2})")
_CRLF = b"\r\n"


class Malformed(ValueError):
    """The body does not parse as its declared content type."""


@dataclass(frozen=True, slots=True)
class Part:
    """One multipart part: what it is and a digest of its content (never the content)."""

    name: str
    filename: str | None
    content_type: str | None
    sha256: str
    size: int
    #: The decoded text of a small part that is no file, else None.
    value: str | None


def kind_of(content_type: str | None) -> BodyKind:
    """Which parser a ``Content-Type`` asks for; anything not form or multipart is JSON."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media == FORM:
        return "form"
    if media == MULTIPART:
        return "multipart"
    return "json"


def parse_form(raw: bytes) -> list[tuple[str, str]]:
    """A form-encoded body's fields, decoded, in order.

    Strictly: a ``%`` that escapes no byte (``%ZZ``) or escapes that decode to no UTF-8
    (``%ff``) are refused. Read leniently, ``%ff`` and ``%fe`` both decode to U+FFFD and
    ``%ZZ`` to itself, as ``%25ZZ`` does: different requests would hash the same, while
    the provider reads them apart (or refuses them)."""
    try:
        text = raw.decode("utf-8")
        if _BAD_ESCAPE.search(text):
            raise ValueError("a % that escapes no byte")
        return parse_qsl(
            text,
            keep_blank_values=True,
            strict_parsing=bool(text),
            max_num_fields=MAX_FIELDS,
            errors="strict",
        )
    except (UnicodeDecodeError, ValueError) as exc:
        raise Malformed(f"request body is not a valid form: {_form_fault(exc, raw)}") from exc


def _form_fault(exc: ValueError, raw: bytes) -> str:
    """Why a form did not parse, in a bounded line: the parser's own message quotes the
    whole offending field, which for a JSON body sent as a form (``curl -d`` without a
    ``Content-Type``) is the whole prompt."""
    reason = str(exc)
    if reason.startswith("bad query field"):
        reason = "a field has no '=' (name=value)"
    if raw.lstrip()[:1] in (b"{", b"["):
        reason += "; it reads as JSON: send JSON with Content-Type: application/json"
    return reason


def boundary_of(content_type: str) -> bytes:
    """The boundary a multipart ``Content-Type`` declares (RFC 2046 §5.1.1: 1-70 chars)."""
    message = Message()
    message["content-type"] = content_type
    if _count(message.get_params() or [], "boundary") > 1:
        # Parsers disagree on which one frames the body: effectguard would hash (and price)
        # other parts than the provider reads.
        raise Malformed("multipart Content-Type names more than one boundary")
    boundary = message.get_param("boundary")
    if not isinstance(boundary, str) or not 0 < len(boundary) <= 70:
        raise Malformed("multipart Content-Type has no valid boundary")
    try:
        return boundary.encode("ascii")
    except UnicodeEncodeError as exc:
        raise Malformed("multipart boundary is not ASCII") from exc


def parse_multipart(raw: Buffer, content_type: str) -> list[Part]:
    """A multipart/form-data body's parts, in order; :class:`Malformed` if framing is wrong.

    ``raw`` is bytes, or a memory map of a spooled upload: only ``find`` and slices are
    used, and a part's content is hashed through a view, never copied."""
    dash = b"--" + boundary_of(content_type)
    delimiter = _CRLF + dash
    with memoryview(raw) as view:
        if _at(raw, 0, dash):
            pos = len(dash)
        else:  # a preamble is allowed and ignored (RFC 2046)
            first = raw.find(delimiter)
            if first < 0:
                raise Malformed("multipart body has no opening boundary")
            pos = first + len(delimiter)
        parts: list[Part] = []
        while not _at(raw, pos, b"--"):  # "--" after a delimiter closes the body
            eol = raw.find(_CRLF, pos)
            if eol < 0 or raw[pos:eol].strip(b" \t"):
                raise Malformed("multipart boundary line is malformed")
            start = eol + 2
            end = raw.find(delimiter, start)
            if end < 0:
                raise Malformed("multipart body is not closed by its final boundary")
            if len(parts) >= MAX_FIELDS:
                raise Malformed(f"multipart body has more than {MAX_FIELDS} parts")
            parts.append(_part(raw, view, start, end))
            pos = end + len(delimiter)
    return parts


def parse_multipart_file(path: str, content_type: str) -> list[Part]:
    """:func:`parse_multipart` over a spooled upload, through a read-only memory map: its
    pages are the kernel's file cache, not this process's heap."""
    with open(path, "rb") as file:
        if os.fstat(file.fileno()).st_size == 0:
            return parse_multipart(b"", content_type)
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return parse_multipart(mapped, content_type)


def _at(raw: Buffer, pos: int, token: bytes) -> bool:
    # bytes.startswith, for a memory map too (which has no startswith).
    return raw[pos : pos + len(token)] == token


def _part(raw: Buffer, view: memoryview, start: int, end: int) -> Part:
    """The part between ``start`` and ``end``: its headers, then its content."""
    headers, body_at = _part_headers(raw, start, end)
    name = _param(headers, "name")
    if name is None:
        raise Malformed("multipart part has no name")
    filename = _param(headers, "filename")
    # Released here, not by the collector: a memory map cannot close while a view lives.
    with view[body_at:end] as content:
        value = None
        if filename is None and len(content) <= MAX_FIELD_BYTES:
            value = bytes(content).decode("utf-8", "replace")
        return Part(
            name=name,
            filename=filename,
            content_type=headers.get("content-type"),
            sha256=hashlib.sha256(content).hexdigest(),
            size=len(content),
            value=value,
        )


def _part_headers(raw: Buffer, start: int, end: int) -> tuple[Message, int]:
    """A part's headers, and where its content starts. They are bounded (the email parser
    takes seconds over megabytes of header lines, on the event loop: every other request
    waits) and must say what the part is once:
    one disposition, one content type, one name and filename, which every reader then
    reads alike."""
    if _at(raw, start, _CRLF):
        head, body_at = b"", start + 2
    else:
        split = raw.find(_CRLF + _CRLF, start, min(end + 2, start + MAX_PART_HEAD_BYTES + 4))
        if split < 0:
            if end - start > MAX_PART_HEAD_BYTES:
                raise Malformed(f"multipart part headers are over {MAX_PART_HEAD_BYTES} bytes")
            raise Malformed("multipart part has no end of headers")
        head, body_at = raw[start:split], min(split + 4, end)
        if head.count(_CRLF) >= MAX_PART_HEAD_LINES:
            raise Malformed(f"multipart part has over {MAX_PART_HEAD_LINES} header lines")
    try:
        headers = BytesHeaderParser().parsebytes(head + _CRLF * 2)
    except Exception as exc:  # the parser's own errors are not one tree
        raise Malformed(f"multipart part headers do not parse: {exc}") from exc
    if headers.get_content_disposition() != "form-data":
        raise Malformed("multipart part is not Content-Disposition: form-data")
    for header in ("content-disposition", "content-type"):
        if len(headers.get_all(header) or []) > 1:
            raise Malformed(f"multipart part has more than one {header} header")
    params = headers.get_params(header="content-disposition") or []
    for key in ("name", "filename"):
        if _count(params, key) > 1:
            raise Malformed(f"multipart part names its {key} more than once")
    return headers, body_at


def _count(params: list[tuple[str, Any]], key: str) -> int:
    """How many of a header's parameters are ``key`` (the email parser lowercases keys
    and folds an RFC 2231 ``key*`` into ``key``, so each spelling counts)."""
    return sum(1 for k, _ in params if k.lower() == key)


def _param(headers: Message, key: str) -> str | None:
    value = headers.get_param(key, header="content-disposition")
    if value is None:
        return None
    return collapse_rfc2231_value(value)


def hashed_form(fields: list[tuple[str, str]]) -> list[list[str]]:
    """What a form request is hashed over: its decoded fields, in order."""
    return [[k, v] for k, v in fields]


def hashed_parts(parts: list[Part]) -> list[list[str | None]]:
    """What a multipart request is hashed over: each part's meaning and content digest."""
    return [[p.name, p.filename, p.content_type, p.sha256] for p in parts]


def part_fields(parts: list[Part]) -> dict[str, Any]:
    """A multipart body's text fields (the last of a repeated name), for pricing: its
    files are not fields."""
    return {p.name: p.value for p in parts if p.value is not None}
