"""PROTOCOL.md's example exchange is the real encoder's output, byte for byte.

Each example frame in PROTOCOL.md is a fenced block tagged `hex`, right after a marker line
naming the message:

    <!-- frame: handoff -->
    ```hex
    00 00 01 9a                                      # frame header: body is 410 bytes
    87                                               # fixmap, 7 entries
    ...
    ```

Everything after `#` on a line is an annotation; the rest is hex bytes, two digits each.
These tests check that every example here appears in the document exactly once, that its bytes
equal `protocol.encode(...)` of the same message constructed below, that they decode back to
that message, and that the annotations are the ones the annotator below writes (so they can
never describe different bytes).

To regenerate the blocks after a protocol change:

    .venv/bin/python tests/test_protocol_doc.py --write
"""

from __future__ import annotations

import re
import struct
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from escrow_client import protocol
from escrowd.config import Config

DOC = Path(__file__).resolve().parent.parent / "PROTOCOL.md"

HANDOFF_ID = "5f0c6a1e9b2d4c7f8a3e6b1d0c9f2a74"
OWNER = "com.example.term"

# The example exchange, in order, with fixed values so the bytes are reproducible. They are
# what a real holder sends with its default settings (see the test of the welcome below).
EXAMPLES: dict[str, protocol.Message] = {
    "hello": protocol.Hello(version=1, owner=OWNER, client="exampleterm 2.4.1", timeout=5.0),
    "welcome": protocol.Welcome(
        version=1,
        holder_version="0.1.0",
        pid=4242,
        drain_stop_budget=3.0,
        send_deadline=1.0,
        ack_deadline=10.0,
        limits={
            "max_sessions": 2048,
            "ring_bytes": 1048576,
            "total_ring_bytes": 536870912,
            "max_connections": 256,
            "max_request_bytes": 1048576,
            "max_tombstones": 10000,
        },
    ),
    "retrieve": protocol.Retrieve(id="tab-1"),
    "handoff": protocol.Handoff(
        handoff_id=HANDOFF_ID,
        session=protocol.SessionInfo(
            owner=OWNER,
            id="tab-1",
            label="zsh",
            state="draining",
            child_pid=31337,
            child_alive=True,
            deposited_at=1767225600.25,
            state_since=1767225612.5,
            buffered_bytes=6,
            dropped_bytes=0,
            custodian_pid=None,
            handoff_id=HANDOFF_ID,
            cols=120,
            rows=40,
            meta={},
        ),
        replay=b"$ ls\r\n",
        dropped_bytes=0,
    ),
    "ack": protocol.Ack(id="tab-1", handoff_id=HANDOFF_ID),
    "done": protocol.Done(id="tab-1"),
}

REQUESTS = {"hello", "retrieve", "ack"}

_BLOCK = re.compile(r"^<!-- frame: (?P<name>[a-z_]+) -->\n```hex\n(?P<body>.*?)^```$", re.M | re.S)


# --- an annotating MessagePack reader (only what the protocol uses) -----------------------------

Row = tuple[bytes, str]
ROW_BYTES = 16
COMMENT_COLUMN = ROW_BYTES * 3 + 1


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int) -> bytes:
        chunk = self.data[self.pos : self.pos + n]
        if len(chunk) != n:
            raise ValueError("MessagePack cut short")
        self.pos += n
        return chunk

    def header(self) -> tuple[bytes, str, int | None, object]:
        """(header bytes, format name, length of what follows or None, scalar value)."""
        start = self.pos
        b = self.take(1)[0]

        def lead(n: int, fmt: str) -> tuple[bytes, str, int | None, object]:
            (length,) = struct.unpack(fmt, self.take(n))
            return self.data[start : self.pos], "", int(length), None

        if b <= 0x7F:
            return bytes([b]), "positive fixint", None, b
        if 0x80 <= b <= 0x8F:
            return bytes([b]), "fixmap", b & 0x0F, None
        if 0x90 <= b <= 0x9F:
            return bytes([b]), "fixarray", b & 0x0F, None
        if 0xA0 <= b <= 0xBF:
            return bytes([b]), "fixstr", b & 0x1F, None
        if b >= 0xE0:
            return bytes([b]), "negative fixint", None, b - 0x100
        simple = {0xC0: ("nil", None), 0xC2: ("false", False), 0xC3: ("true", True)}
        if b in simple:
            name, value = simple[b]
            return bytes([b]), name, None, value
        sized = {0xC4: (1, ">B", "bin8"), 0xC5: (2, ">H", "bin16"), 0xC6: (4, ">I", "bin32"),
                 0xD9: (1, ">B", "str8"), 0xDA: (2, ">H", "str16"), 0xDB: (4, ">I", "str32"),
                 0xDC: (2, ">H", "array16"), 0xDD: (4, ">I", "array32"),
                 0xDE: (2, ">H", "map16"), 0xDF: (4, ">I", "map32")}
        if b in sized:
            n, fmt, name = sized[b]
            raw, _, length, _ = lead(n, fmt)
            return raw, name, length, None
        numbers = {0xCA: (4, ">f", "float32"), 0xCB: (8, ">d", "float64"),
                   0xCC: (1, ">B", "uint8"), 0xCD: (2, ">H", "uint16"),
                   0xCE: (4, ">I", "uint32"), 0xCF: (8, ">Q", "uint64"),
                   0xD0: (1, ">b", "int8"), 0xD1: (2, ">h", "int16"),
                   0xD2: (4, ">i", "int32"), 0xD3: (8, ">q", "int64")}
        if b in numbers:
            n, fmt, name = numbers[b]
            (value,) = struct.unpack(fmt, self.take(n))
            return self.data[start : self.pos], name, None, value
        raise ValueError(f"MessagePack type byte {b:#04x} is not used by the protocol")


def _show(value: object) -> str:
    if value is None:
        return "nil"
    if value is True or value is False:
        return str(value).lower()
    if isinstance(value, str):
        return '"' + value.encode("unicode_escape").decode("ascii").replace('"', '\\"') + '"'
    if isinstance(value, bytes):
        return 'b"' + "".join(
            chr(c) if 0x20 <= c < 0x7F and c not in b'"\\' else f"\\x{c:02x}" for c in value
        ).replace("\\x0d", "\\r").replace("\\x0a", "\\n") + '"'
    return repr(value)


def _value(r: _Reader, depth: int, key: str | None) -> Iterator[Row]:
    """Rows for one value; `key` is the map key it belongs to (its bytes come first)."""
    key_bytes = b""
    label = ""
    if key is not None:
        key_bytes = _str_bytes(key)
        label = f"{_show(key)}: "
    indent = "  " * depth
    raw, fmt, length, scalar = r.header()
    if fmt in ("fixmap", "map16", "map32"):
        assert length is not None
        yield key_bytes + raw, f"{indent}{label}{fmt}, {length} entries"
        for _ in range(length):
            k_raw, k_fmt, k_len, _ = r.header()
            assert k_fmt in ("fixstr", "str8") and k_len is not None
            k = r.take(k_len).decode()
            assert _str_bytes(k) == k_raw + k.encode()
            yield from _value(r, depth + 1, k)
        return
    if fmt in ("fixarray", "array16", "array32"):
        assert length is not None
        yield key_bytes + raw, f"{indent}{label}{fmt}, {length} items"
        for _ in range(length):
            yield from _value(r, depth + 1, None)
        return
    if fmt in ("fixstr", "str8", "str16", "str32", "bin8", "bin16", "bin32"):
        assert length is not None
        payload = r.take(length)
        shown = _show(payload if fmt.startswith("bin") else payload.decode())
        kind = f"{fmt}, {length} bytes"
        yield from _rows(key_bytes + raw + payload, f"{indent}{label}{shown} ({kind})")
        return
    shown = _show(scalar)
    kind = "" if shown == fmt else f" ({fmt})"  # nil, true and false name themselves
    yield from _rows(key_bytes + raw, f"{indent}{label}{shown}{kind}")


def _str_bytes(text: str) -> bytes:
    data = text.encode()
    assert len(data) < 32, "map keys in this protocol are short"
    return bytes([0xA0 | len(data)]) + data


def _rows(data: bytes, comment: str) -> Iterator[Row]:
    for i in range(0, len(data), ROW_BYTES):
        yield data[i : i + ROW_BYTES], comment if i == 0 else ""


def annotate(frame: bytes) -> str:
    """The annotated hex block for one whole frame (header and body)."""
    (length,) = protocol.HEADER.unpack(frame[:4])
    rows: list[Row] = [(frame[:4], f"frame header: the body is {length} bytes (big-endian u32)")]
    reader = _Reader(frame[4:])
    rows += list(_value(reader, 0, None))
    if reader.pos != len(frame) - 4:
        raise ValueError("trailing bytes after the body")
    lines = []
    for data, comment in rows:
        hexes = " ".join(f"{b:02x}" for b in data)
        lines.append(f"{hexes:<{COMMENT_COLUMN}}# {comment}".rstrip() if comment else hexes)
    return "\n".join(lines) + "\n"


def block(name: str) -> str:
    return f"<!-- frame: {name} -->\n```hex\n{annotate(protocol.encode(EXAMPLES[name]))}```"


# --- reading the document -----------------------------------------------------------------------


def doc_blocks(text: str) -> list[tuple[str, str]]:
    return [(m["name"], m["body"]) for m in _BLOCK.finditer(text)]


def hex_bytes(body: str) -> bytes:
    out = bytearray()
    for number, line in enumerate(body.splitlines(), 1):
        for token in line.split("#", 1)[0].split():
            if not re.fullmatch(r"[0-9a-f]{2}", token):
                raise AssertionError(f"line {number}: {token!r} is not a hex byte")
            out.append(int(token, 16))
    return bytes(out)


@pytest.fixture(scope="module")
def blocks() -> dict[str, str]:
    found = doc_blocks(DOC.read_text(encoding="utf-8"))
    names = [name for name, _ in found]
    assert len(names) == len(set(names)), f"a frame appears twice in PROTOCOL.md: {names}"
    return dict(found)


def test_every_example_is_in_the_document_in_order(blocks: dict[str, str]) -> None:
    assert list(blocks) == list(EXAMPLES)


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_the_bytes_are_the_encoders(blocks: dict[str, str], name: str) -> None:
    frame = hex_bytes(blocks[name])
    expected = protocol.encode(EXAMPLES[name])
    assert frame.hex(" ") == expected.hex(" "), (
        f"PROTOCOL.md's {name} frame differs from protocol.encode(); regenerate it with "
        "`.venv/bin/python tests/test_protocol_doc.py --write`"
    )
    (length,) = protocol.HEADER.unpack(frame[:4])
    assert length == len(frame) - 4


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_the_bytes_decode_to_the_message(blocks: dict[str, str], name: str) -> None:
    body = hex_bytes(blocks[name])[4:]
    decode = protocol.decode_request if name in REQUESTS else protocol.decode_response
    assert decode(body) == EXAMPLES[name]


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_the_annotations_describe_these_bytes(blocks: dict[str, str], name: str) -> None:
    assert blocks[name] == annotate(protocol.encode(EXAMPLES[name])), (
        f"PROTOCOL.md's {name} annotations are stale; regenerate them with "
        "`.venv/bin/python tests/test_protocol_doc.py --write`"
    )


def test_the_example_is_a_handoff_with_one_fd() -> None:
    assert isinstance(EXAMPLES["handoff"], protocol.FD_CARRIERS)
    carriers = [n for n, m in EXAMPLES.items() if isinstance(m, protocol.FD_CARRIERS)]
    assert carriers == ["handoff"]


def test_the_example_welcome_shows_the_default_settings() -> None:
    """The welcome in the document is what a holder with default settings sends."""
    welcome = EXAMPLES["welcome"]
    assert isinstance(welcome, protocol.Welcome)
    defaults = Config(socket_path="")
    assert welcome.limits == defaults.limits()
    assert welcome.drain_stop_budget == defaults.drain_stop_budget
    assert welcome.send_deadline == defaults.send_deadline
    assert welcome.ack_deadline == defaults.ack_deadline
    assert welcome.version == protocol.VERSION
    # The example client honours the timeout invariant against it.
    hello = EXAMPLES["hello"]
    assert isinstance(hello, protocol.Hello) and hello.timeout is not None
    assert hello.timeout > welcome.drain_stop_budget + welcome.send_deadline


def test_hex_bytes_reads_the_documented_format() -> None:
    assert hex_bytes("00 0a   # header\n# a comment only\nff\n") == b"\x00\x0a\xff"
    with pytest.raises(AssertionError):
        hex_bytes("0g")


def write_blocks() -> None:
    text = DOC.read_text(encoding="utf-8")
    for name in EXAMPLES:
        pattern = re.compile(rf"^<!-- frame: {name} -->\n```hex\n.*?^```$", re.M | re.S)
        text, count = pattern.subn(lambda _m, n=name: block(n), text)  # type: ignore[misc]
        if count != 1:
            raise SystemExit(f"PROTOCOL.md has {count} blocks for {name}, not 1")
    DOC.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write_blocks()
    else:
        for example in EXAMPLES:
            print(block(example), end="\n\n")
