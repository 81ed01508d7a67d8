"""PROTOCOL.md, the test vectors in protocol-vectors/ and client/protocol.py agree, byte for byte.

Each frame PROTOCOL.md shows is a fenced block tagged `hex`, right after a marker line
naming it:

    <!-- frame: handoff -->
    ```hex
    00 00 01 4d                                      # frame header: the body is 333 bytes
    85                                               # fixmap, 5 entries
    ...
    ```

Everything after `#` on a line is an annotation; the rest is hex bytes, two digits each. The
same frame is a test vector, `protocol-vectors/<name>.json`: its bytes, and what they decode
to. These tests check, for every example below, that:

- the document shows it exactly once, under the section the example names, and its bytes are
  `protocol.encode()` of the message and decode back to it; its annotations are the ones the
  annotator here writes (so they can never describe other bytes);
- its vector file is exactly what `--write` makes of it, its bytes are the document's, and
  they encode from and decode to the vector's `message` (both directions);

and that section 7's table lists every field of every message with the type, default and
limit `client/protocol.py` gives it, that the fds each message carries are the code's, that
the states and error codes the document lists are the code's, that the journal file's
header shown in section 10.6 is the one the holder makes, and that the Linux constants of
section 13 and the control-message layouts of section 4.4 are this system's.

After a protocol change, regenerate the blocks and the vectors:

    .venv/bin/python tests/test_protocol_doc.py --write
"""

from __future__ import annotations

import fcntl
import json
import os
import platform
import re
import socket
import struct
import sys
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from escrow_client import platform as escrow_platform
from escrow_client import protocol
from escrowd.config import Config
from escrowd.modes import Scanner

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "PROTOCOL.md"
VECTORS = ROOT / "protocol-vectors"

HANDOFF_ID = "5f0c6a1e9b2d4c7f8a3e6b1d0c9f2a74"
HANDOFF_ID_2 = "9d3b7e21c4a85f60b1e2d7c93a4f0e58"
HANDOFF_ID_3 = "2a6f0d94e1b7c35a8f4e9c0d6b3a1e72"
HANDOFF_ID_4 = "c81e4a7f2b9d06e35a1f8c4b7d2e9a60"
HANDOFF_ID_5 = "e5b2c7a9d1f3408e6a2b9c5d7f1e3a84"
OWNER = "com.example.term"
RING_BYTES = 1048576  # a holder's default --ring-bytes

_TAB_1 = protocol.SessionInfo(
    owner=OWNER, id="tab-1", label="zsh", state="draining", child_pid=31337, child_alive=True,
    deposited_at=1767225600.25, state_since=1767225612.5, buffered_bytes=6, dropped_bytes=0,
    custodian_pid=None, handoff_id=HANDOFF_ID, cols=120, rows=40, meta={"cwd": "/home/ann"},
)

# Section 14.6-14.8: tab-3 deposited with a journal, tab-4 without; the app recorded
# "$ make\r\n" of tab-3, then crashed; the holder drained "done\r\n$ " of tab-3 and "db1$ " of
# tab-4 after it; the relaunched app takes both back into custody.
_TAB_3 = protocol.SessionInfo(
    owner=OWNER, id="tab-3", label="bash", state="draining", child_pid=31339,
    child_alive=True, deposited_at=1767225602.5, state_since=1767225655.25,
    buffered_bytes=16, dropped_bytes=0, custodian_pid=None, handoff_id=HANDOFF_ID_2,
    cols=100, rows=30, meta={"cwd": "/home/ann/src"},
)
_TAB_4 = protocol.SessionInfo(
    owner=OWNER, id="tab-4", label="ssh", state="draining", child_pid=31340,
    child_alive=True, deposited_at=1767225603.75, state_since=1767225655.25,
    buffered_bytes=5, dropped_bytes=0, custodian_pid=None, handoff_id=HANDOFF_ID_3,
    cols=100, rows=30, meta={},
)

# Every frame the document shows, in the order it shows them, with the section it is in.
# Fixed values, so the bytes are reproducible; the welcome is what a holder with default
# settings sends (see its test below).
EXAMPLES: dict[str, tuple[str, protocol.Message]] = {
    "hello": ("14.1", protocol.Hello(version=1, owner=OWNER, client="exampleterm 2.4.1",
                                     timeout=5.0)),
    "welcome": ("14.1", protocol.Welcome(
        version=1, holder_version="0.1.0", pid=4242, drain_stop_budget=3.0,
        send_deadline=1.0, ack_deadline=10.0,
        limits={"max_sessions": 2048, "ring_bytes": 1048576, "total_ring_bytes": 536870912,
                "max_connections": 256, "max_sessions_per_owner": 1024,
                "owner_ring_bytes": 268435456, "max_connections_per_owner": 128,
                "max_request_bytes": 1048576, "max_tombstones": 10000},
    )),
    "retrieve": ("14.1", protocol.Retrieve(id="tab-1")),
    "handoff": ("14.1", protocol.Handoff(handoff_id=HANDOFF_ID, session=_TAB_1,
                                         replay=b"$ ls\r\n", dropped_bytes=0)),
    "ack": ("14.1", protocol.Ack(id="tab-1", handoff_id=HANDOFF_ID)),
    "done": ("14.1", protocol.Done(id="tab-1")),
    "deposit": ("14.2", protocol.Deposit(id="tab-1", label="zsh", child_pid=31337, cols=120,
                                         rows=40, meta={"cwd": "/home/ann"})),
    "deposited": ("14.2", protocol.Deposited(id="tab-1")),
    "error_custody_held": ("14.4", protocol.Error(
        code="custody_held", message="session com.example.term/tab-1 is still held by its app",
        id="tab-1",
    )),
    "error_unsupported_version": ("14.4", protocol.Error(
        code="unsupported_version",
        message="protocol version 2 is not supported; this holder speaks 1", versions=[1],
    )),
    "list": ("14.5", protocol.List(all_owners=False)),
    "sessions": ("14.5", protocol.Sessions(sessions=[
        protocol.SessionInfo(
            owner=OWNER, id="tab-2", label="vim", state="draining", child_pid=31338,
            child_alive=True, deposited_at=1767225601.5, state_since=1767225612.5,
            buffered_bytes=2, dropped_bytes=0, custodian_pid=None, handoff_id=None, cols=120,
            rows=40, meta={"cwd": "/home/ann"},
        ),
        msgspec.structs.replace(_TAB_1, state="handed_off", state_since=1767225613.0,
                                buffered_bytes=0, meta={}),
    ])),
    "deposit_journal": ("14.6", protocol.Deposit(
        id="tab-3", label="bash", child_pid=31339, cols=100, rows=30,
        meta={"cwd": "/home/ann/src"}, journal=True,
    )),
    "deposited_journal": ("14.6", protocol.Deposited(
        id="tab-3", journal=protocol.Journal(capacity=RING_BYTES, total=0, position=0),
    )),
    "retrieve_many": ("14.7", protocol.RetrieveMany(ids=["tab-3", "tab-4", "tab-9"],
                                                    keep=True, journal=True)),
    "error_unknown": ("14.7", protocol.Error(
        code="unknown", message="no session com.example.term/tab-9 is known", id="tab-9",
    )),
    "handoff_journal": ("14.7", protocol.Handoff(
        handoff_id=HANDOFF_ID_2, session=_TAB_3, replay=b"$ make\r\ndone\r\n$ ",
        dropped_bytes=0, replay_trimmed=0, replay_journaled=8,
        journal=protocol.Journal(capacity=RING_BYTES, total=0, position=0),
    )),
    "handoff_journal_2": ("14.7", protocol.Handoff(
        handoff_id=HANDOFF_ID_3, session=_TAB_4, replay=b"db1$ ", dropped_bytes=0,
        replay_trimmed=0, replay_journaled=0,
        journal=protocol.Journal(capacity=RING_BYTES, total=0, position=0),
    )),
    "ack_many": ("14.7", protocol.AckMany(acks={"tab-3": HANDOFF_ID_2, "tab-4": HANDOFF_ID_3},
                                          keep=True)),
    "done_many": ("14.7", protocol.DoneMany(ids=["tab-3", "tab-4"])),
    "update": ("14.8", protocol.Update(id="tab-3", cols=132, rows=43)),
    "updated": ("14.8", protocol.Updated(id="tab-3")),
    # Section 14.9: tab-2 (vim) was taken back into custody without a journal, its replay
    # delivered; the app crashed; the holder drained the 14 bytes of vim's clock since.
    "handoff_modes": ("14.9", protocol.Handoff(
        handoff_id=HANDOFF_ID_4, session=protocol.SessionInfo(
            owner=OWNER, id="tab-2", label="vim", state="draining", child_pid=31338,
            child_alive=True, deposited_at=1767225601.5, state_since=1767225700.0,
            buffered_bytes=14, dropped_bytes=0, custodian_pid=None, handoff_id=HANDOFF_ID_4,
            cols=120, rows=40, meta={"cwd": "/home/ann"}),
        replay=b"\x1b[?1049h\x1b[?1h\x1b=\x1b[?2004h" + b"\x1b[40;110H12:05",
        restored_modes=["alternate_screen", "cursor_keys", "keypad", "bracketed_paste"],
        replay_preamble=23,
    )),
    # Section 14.10: tab-1 of 14.1 again, taken back into custody by a client that reads
    # its replays from the holder's replay file.
    "retrieve_many_replay_file": ("14.10", protocol.RetrieveMany(
        ids=["tab-1", "tab-2"], keep=True, replay_file=True)),
    "handoff_replay_file": ("14.10", protocol.Handoff(
        handoff_id=HANDOFF_ID, session=_TAB_1, replay=b"",
        replay_file=protocol.ReplayFile(offset=0, length=6))),
    # Section 14.11: the app of 14.7 relaunched after the holder was SIGKILLed under its
    # keeper: status first (who answered, what it adopted), then tab-3 into custody again.
    "status": ("14.11", protocol.Status()),
    "holder_status": ("14.11", protocol.HolderStatus(
        pid=4243, version="0.1.0", started_at=1767225700.5,
        socket="/run/user/1000/escrowd/escrowd.sock",
        sessions_by_state={"draining": 3}, counters={"connections": 1}, limits={},
        open_fds=17, rss_bytes=31457280, instance="7c1e9a04", fd_store="keeper",
        keeper_pid=4200, adopted=3, restarts=1, unclean_restarts=1,
        adopted_without_record=1, adopted_renamed=0,
    )),
    "retrieve_keep": ("14.11", protocol.Retrieve(id="tab-3", keep=True, journal=True)),
    "ack_keep": ("14.11", protocol.Ack(id="tab-3", handoff_id=HANDOFF_ID_2, keep=True)),
    # Section 14.12: the holder starts `make` in a new session and hands it into custody;
    # later, detached, the app asks how it ended.
    "start": ("14.12", protocol.Start(
        id="build-1", argv=["sh", "-c", "make"], cwd="/home/ann/src",
        env={"TERM": "xterm-256color"}, label="make", cols=100, rows=30)),
    "handoff_start": ("14.12", protocol.Handoff(
        handoff_id=HANDOFF_ID_5, session=protocol.SessionInfo(
            owner=OWNER, id="build-1", label="make", state="draining", child_pid=31341,
            child_alive=True, deposited_at=1767225800.0, state_since=1767225800.0,
            buffered_bytes=0, dropped_bytes=0, custodian_pid=None, handoff_id=HANDOFF_ID_5,
            cols=100, rows=30, started=True),
        replay=b"")),
    "wait": ("14.12", protocol.Wait(id="build-1")),
    "waited": ("14.12", protocol.Waited(id="build-1",
                                        exit_status=protocol.ExitStatus(code=2))),
}


def message(name: str) -> protocol.Message:
    return EXAMPLES[name][1]


def is_request(msg: protocol.Message) -> bool:
    return isinstance(msg, typing.get_args(protocol.Request))


_BLOCK = re.compile(r"^<!-- (?P<kind>frame|cmsg|journal): (?P<name>[a-z0-9_-]+) -->\n```hex\n"
                    r"(?P<body>.*?)^```$", re.M | re.S)


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
        yield from _rows(key_bytes + raw, f"{indent}{label}{fmt}, "
                         f"{_count(length, 'entry', 'entries')}")
        for _ in range(length):
            k_raw, k_fmt, k_len, _ = r.header()
            assert k_fmt in ("fixstr", "str8") and k_len is not None
            k = r.take(k_len).decode()
            assert _str_bytes(k) == k_raw + k.encode()
            yield from _value(r, depth + 1, k)
        return
    if fmt in ("fixarray", "array16", "array32"):
        assert length is not None
        yield from _rows(key_bytes + raw, f"{indent}{label}{fmt}, "
                         f"{_count(length, 'item', 'items')}")
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


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


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
    return f"<!-- frame: {name} -->\n```hex\n{annotate(protocol.encode(message(name)))}```"


# --- the test vectors -----------------------------------------------------------------------------


def _json_ready(value: Any) -> Any:
    """Builtins as JSON holds them: a MessagePack bin becomes {"bin": "<hex>"}."""
    if isinstance(value, bytes):
        return {"bin": value.hex()}
    if isinstance(value, dict):
        return {k: _json_ready(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_ready(v) for v in value]
    return value


def _from_json(value: Any) -> Any:
    if isinstance(value, dict):
        if list(value) == ["bin"]:
            return bytes.fromhex(value["bin"])
        return {k: _from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    return value


def as_json(msg: protocol.Message) -> Any:
    return _json_ready(msgspec.to_builtins(msg, builtin_types=(bytes,)))


def vector(name: str) -> dict[str, Any]:
    section, msg = EXAMPLES[name]
    return {
        "name": name,
        "section": section,
        "direction": "client_to_holder" if is_request(msg) else "holder_to_client",
        "fds": protocol.fds_carried(msg),
        "frame": protocol.encode(msg).hex(),
        "message": as_json(msg),
    }


def vector_text(name: str) -> str:
    return json.dumps(vector(name), indent=2, ensure_ascii=False) + "\n"


def load_vectors() -> dict[str, dict[str, Any]]:
    """Every vector file, by name (also used by the C client's tests)."""
    return {p.stem: json.loads(p.read_text(encoding="utf-8"))
            for p in sorted(VECTORS.glob("*.json"))}


def decode_any(frame: bytes, direction: str) -> protocol.Message:
    decode = protocol.decode_request if direction == "client_to_holder" else (
        protocol.decode_response)
    (length,) = protocol.HEADER.unpack(frame[:4])
    assert length == len(frame) - 4, "the header is the body's length"
    return decode(frame[4:])


# --- reading the document -----------------------------------------------------------------------


def doc_text() -> str:
    return DOC.read_text(encoding="utf-8")


def doc_blocks(text: str, kind: str = "frame") -> list[tuple[str, str]]:
    return [(m["name"], m["body"]) for m in _BLOCK.finditer(text) if m["kind"] == kind]


def hex_bytes(body: str) -> bytes:
    out = bytearray()
    for number, line in enumerate(body.splitlines(), 1):
        for token in line.split("#", 1)[0].split():
            if not re.fullmatch(r"[0-9a-f]{2}", token):
                raise AssertionError(f"line {number}: {token!r} is not a hex byte")
            out.append(int(token, 16))
    return bytes(out)


def doc_section(text: str, number: str) -> str:
    """The text of section `number` ("7", "14.1"), up to the next heading of its level."""
    level = "##" if "." not in number else "###"
    match = re.search(rf"^{level} {re.escape(number)}[. ].*?(?=^#{{2,{len(level)}}} |\Z)",
                      text, re.M | re.S)
    assert match, f"PROTOCOL.md has no section {number}"
    return match.group(0)


def table_rows(section: str) -> list[list[str]]:
    """The body rows of the markdown tables in `section`, cells stripped and unescaped."""
    rows = []
    for line in section.splitlines():
        if not line.startswith("|") or re.fullmatch(r"\|[-| ]+\|", line):
            continue
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        rows.append(cells)
    return rows


@pytest.fixture(scope="module")
def blocks() -> dict[str, str]:
    found = doc_blocks(doc_text())
    names = [name for name, _ in found]
    assert len(names) == len(set(names)), f"a frame appears twice in PROTOCOL.md: {names}"
    return dict(found)


# --- the frames in the document -------------------------------------------------------------------


def test_every_example_is_in_the_document_in_order(blocks: dict[str, str]) -> None:
    assert list(blocks) == list(EXAMPLES)


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_each_frame_is_in_its_section(name: str) -> None:
    section = doc_section(doc_text(), EXAMPLES[name][0])
    assert f"<!-- frame: {name} -->" in section


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_the_bytes_are_the_encoders(blocks: dict[str, str], name: str) -> None:
    frame = hex_bytes(blocks[name])
    expected = protocol.encode(message(name))
    assert frame.hex(" ") == expected.hex(" "), (
        f"PROTOCOL.md's {name} frame differs from protocol.encode(); regenerate it with "
        "`.venv/bin/python tests/test_protocol_doc.py --write`"
    )


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_the_bytes_decode_to_the_message(blocks: dict[str, str], name: str) -> None:
    direction = vector(name)["direction"]
    assert decode_any(hex_bytes(blocks[name]), direction) == message(name)


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_the_annotations_describe_these_bytes(blocks: dict[str, str], name: str) -> None:
    assert blocks[name] == annotate(protocol.encode(message(name))), (
        f"PROTOCOL.md's {name} annotations are stale; regenerate them with "
        "`.venv/bin/python tests/test_protocol_doc.py --write`"
    )


def test_the_frames_shown_with_fds() -> None:
    """Section 14 shows every way a message carries fds: a deposit's master, a handoff's
    master (and journal file, with a journal; and replay file, by reference), a deposited's
    journal file (with a journal)."""
    carriers = {n: protocol.fds_carried(m) for n, (_, m) in EXAMPLES.items()
                if protocol.fds_carried(m)}
    assert carriers == {"handoff": 1, "deposit": 1, "deposit_journal": 1,
                        "deposited_journal": 1, "handoff_journal": 2, "handoff_journal_2": 2,
                        "handoff_modes": 1, "handoff_replay_file": 2, "handoff_start": 1}


def test_the_example_welcome_shows_the_default_settings() -> None:
    """The welcome in the document is what a holder with default settings sends."""
    welcome = message("welcome")
    assert isinstance(welcome, protocol.Welcome)
    defaults = Config(socket_path="")
    assert welcome.limits == defaults.limits()
    assert welcome.drain_stop_budget == defaults.drain_stop_budget
    assert welcome.send_deadline == defaults.send_deadline
    assert welcome.ack_deadline == defaults.ack_deadline
    assert welcome.version == protocol.VERSION
    # The example client honours the timeout invariant against it, with a second to spare.
    hello = message("hello")
    assert isinstance(hello, protocol.Hello) and hello.timeout is not None
    assert hello.timeout >= welcome.drain_stop_budget + welcome.send_deadline + 1.0


@pytest.mark.parametrize("name", ["handoff", "handoff_journal", "handoff_journal_2",
                                  "handoff_modes", "handoff_replay_file"])
def test_the_example_handoff_keeps_its_promises(name: str) -> None:
    """Section 7: the handoff's own dropped_bytes and handoff_id equal its session's,
    buffered_bytes is the replay's length (in the frame, or in the replay file) less its
    preamble with what was trimmed, what the app recorded is part of the replay, and the
    preamble sets the modes it names."""
    handoff = message(name)
    assert isinstance(handoff, protocol.Handoff)
    assert handoff.dropped_bytes == handoff.session.dropped_bytes
    assert handoff.handoff_id == handoff.session.handoff_id
    where = handoff.replay_file
    length = len(handoff.replay) if where is None else where.length
    assert where is None or handoff.replay == b""
    assert handoff.session.buffered_bytes == (length - handoff.replay_preamble
                                              + handoff.replay_trimmed)
    assert 0 <= handoff.replay_journaled <= length - handoff.replay_preamble
    assert handoff.session.state in ("draining", "exited")
    scanner = Scanner()
    scanner.feed(handoff.replay[: handoff.replay_preamble])
    assert scanner.modes.preamble() == (handoff.replay[: handoff.replay_preamble],
                                        handoff.restored_modes)


def test_the_example_journals_are_fresh_journal_files() -> None:
    """Section 14.6-14.7: every journal granted (at the deposit, and with each handoff into
    custody) is a fresh journal file's: a ring of the default size whose `total` is 0, the
    byte numbered 0 at data[0]; what the app recorded before its crash comes back at the
    start of the replay, counted in `replay_journaled`."""
    deposited = message("deposited_journal")
    tab_3, tab_4 = message("handoff_journal"), message("handoff_journal_2")
    assert isinstance(deposited, protocol.Deposited)
    assert isinstance(tab_3, protocol.Handoff) and isinstance(tab_4, protocol.Handoff)
    fresh = protocol.Journal(capacity=RING_BYTES, total=0, position=0)
    assert deposited.journal == tab_3.journal == tab_4.journal == fresh
    recorded = b"$ make\r\n"  # what the app recorded into the journal of 14.6
    assert tab_3.replay.startswith(recorded) and tab_3.replay_journaled == len(recorded)
    assert tab_4.replay_journaled == 0  # deposited without a journal


def test_the_example_retrieve_many_is_answered_once_per_id() -> None:
    """Section 14.7: one answer per id; the ack_many names each handoff taken with its
    handoff_id, and done_many confirms them."""
    request = message("retrieve_many")
    assert isinstance(request, protocol.RetrieveMany) and request.keep and request.journal
    handoffs = [message("handoff_journal"), message("handoff_journal_2")]
    error = message("error_unknown")
    assert isinstance(error, protocol.Error)
    answered = [error.id]
    acks = {}
    for handoff in handoffs:
        assert isinstance(handoff, protocol.Handoff) and handoff.journal is not None
        answered.append(handoff.session.id)
        acks[handoff.session.id] = handoff.handoff_id
    assert sorted(str(a) for a in answered) == sorted(request.ids)
    ack = message("ack_many")
    assert isinstance(ack, protocol.AckMany) and ack.keep and ack.acks == acks
    done = message("done_many")
    assert isinstance(done, protocol.DoneMany) and done.ids == list(acks)


def test_the_example_list_holds_a_tombstone() -> None:
    sessions = message("sessions")
    assert isinstance(sessions, protocol.Sessions)
    states = [s.state for s in sessions.sessions]
    assert states[0] in protocol.LIVE_STATES and states[-1] in protocol.TOMBSTONE_STATES
    tomb = sessions.sessions[-1]
    assert (tomb.buffered_bytes, tomb.custodian_pid, tomb.meta) == (0, None, {})


def test_hex_bytes_reads_the_documented_format() -> None:
    assert hex_bytes("00 0a   # header\n# a comment only\nff\n") == b"\x00\x0a\xff"
    with pytest.raises(AssertionError):
        hex_bytes("0g")


# --- the vector files ---------------------------------------------------------------------------


def test_there_is_one_vector_file_per_frame() -> None:
    assert sorted(load_vectors()) == sorted(EXAMPLES)


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_the_vector_file_is_current(name: str) -> None:
    path = VECTORS / f"{name}.json"
    assert path.read_text(encoding="utf-8") == vector_text(name), (
        f"{path.relative_to(ROOT)} is stale; regenerate it with "
        "`.venv/bin/python tests/test_protocol_doc.py --write`"
    )


def test_the_vector_readme_shows_a_current_vector() -> None:
    """protocol-vectors/README.md shows the retrieve vector: its frame and message are the
    file's."""
    readme = (VECTORS / "README.md").read_text(encoding="utf-8")
    shown = json.loads(readme.split("```json\n", 1)[1].split("```", 1)[0])
    assert shown == load_vectors()[shown["name"]]


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_the_vector_is_the_documents_frame(blocks: dict[str, str], name: str) -> None:
    frame = bytes.fromhex(load_vectors()[name]["frame"])
    assert frame.hex(" ") == hex_bytes(blocks[name]).hex(" ")


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_the_vector_round_trips_both_ways(name: str) -> None:
    """The vector's bytes decode to its `message`, and its `message` encodes to its bytes."""
    v = load_vectors()[name]
    frame = bytes.fromhex(v["frame"])
    decoded = decode_any(frame, v["direction"])
    assert as_json(decoded) == v["message"]
    union = protocol.Request if v["direction"] == "client_to_holder" else protocol.Response
    rebuilt = msgspec.convert(_from_json(v["message"]), type=union)
    assert protocol.encode(rebuilt) == frame
    assert v["fds"] == protocol.fds_carried(decoded)


# --- section 7: every field of every message ------------------------------------------------------


MESSAGES: dict[str, type[msgspec.Struct]] = {
    **{str(cls.__struct_config__.tag): cls
       for cls in typing.get_args(protocol.Request) + typing.get_args(protocol.Response)},
    "SessionInfo": protocol.SessionInfo,
    "Journal": protocol.Journal,
    "ReplayFile": protocol.ReplayFile,
    "ExitStatus": protocol.ExitStatus,
    "Modes": protocol.Modes,
}


def describe(t: msgspec.inspect.Type) -> tuple[str, str]:
    """(type, limit) of a field, written as section 7 writes them."""
    mi = msgspec.inspect
    if isinstance(t, mi.UnionType):
        inner = [describe(x) for x in t.types if not isinstance(x, mi.NoneType)]
        nil = " | nil" if any(isinstance(x, mi.NoneType) for x in t.types) else ""
        limits = [limit for _, limit in inner if limit != "—"]
        return " | ".join(kind for kind, _ in inner) + nil, "; ".join(limits) or "—"
    if isinstance(t, mi.IntType):
        return "int", "—" if t.ge is None and t.le is None else f"{t.ge} .. {t.le}"
    if isinstance(t, mi.StrType):
        if t.pattern is not None:
            return "str", "name"
        return "str", "—" if t.max_length is None else f"≤ {t.max_length} code points"
    if isinstance(t, mi.DictType):
        kind = f"map[{describe(t.key_type)[0]}]{describe(t.value_type)[0]}"
        if t.max_length is None:
            return kind, "—"
        if describe(t.key_type)[1] == "name":
            return kind, f"{t.min_length or 0} .. {t.max_length} entries; keys names"
        assert isinstance(t.key_type, mi.StrType) and isinstance(t.value_type, mi.StrType)
        return kind, (f"≤ {t.max_length} entries; keys ≤ {t.key_type.max_length}, values "
                      f"≤ {t.value_type.max_length} code points")
    if isinstance(t, mi.ListType):
        kind, item_limit = describe(t.item_type)
        if t.min_length is None and t.max_length is None:
            return f"list[{kind}]", "—"
        if item_limit == "name":
            return f"list[{kind}]", f"{t.min_length or 0} .. {t.max_length} names"
        return f"list[{kind}]", f"{t.min_length or 0} .. {t.max_length} items, each {item_limit}"
    if isinstance(t, mi.StructType):
        return t.cls.__name__, "—"
    if isinstance(t, mi.LiteralType):
        if set(t.values) == set(typing.get_args(protocol.SessionState)):
            return "str", "a state (section 10.1)"
        return "str", " or ".join(f'`"{v}"`' for v in t.values)
    simple = {mi.FloatType: "float", mi.BoolType: "bool", mi.BytesType: "bytes"}
    return simple[type(t)], "—"


def show_default(field: msgspec.inspect.Field) -> str:
    if field.required:
        return "required"
    value = field.default_factory() if field.default is msgspec.NODEFAULT else field.default
    shown = {None: "nil", False: "false", True: "true"}
    if isinstance(value, bool) or value is None:
        return f"`{shown[value]}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    return f"`{value!r}`"


def field_table() -> list[tuple[str, str, str, str, str]]:
    """(message, field, type, default, limit) for every row of section 7's table."""
    rows = []
    message_name = ""
    for cells in table_rows(doc_section(doc_text(), "7")):
        if cells[0] == "message":
            continue
        if cells[0]:
            match = re.match(r"`(\w+)`", cells[0])
            assert match, cells
            message_name = match.group(1)
        rows.append((message_name, cells[1].strip("`"), cells[2], cells[3], cells[4]))
    return rows


def expected_field_table() -> list[tuple[str, str, str, str, str]]:
    rows = []
    for name, cls in MESSAGES.items():
        info = msgspec.inspect.type_info(cls)
        assert isinstance(info, msgspec.inspect.StructType)
        if not info.fields:
            rows.append((name, "", "", "", ""))
        for f in info.fields:
            kind, limit = describe(f.type)
            rows.append((name, f.name, kind, show_default(f), limit))
    return rows


def test_the_field_table_is_the_code() -> None:
    """Every field of every message, in encoding order, with its type, default and limit as
    client/protocol.py defines them: the table can never promise what the code does not do."""
    documented = field_table()
    expected = expected_field_table()
    assert sorted({row[0] for row in documented}) == sorted(MESSAGES)
    for doc_row, code_row in zip(documented, expected, strict=False):
        assert doc_row == code_row, f"PROTOCOL.md section 7: {doc_row} should be {code_row}"
    assert len(documented) == len(expected)


_FD_MARKS = {"+1 fd": {1}, "+1 fd with `journal`": {0, 1},
             "+1 fd; +1 with `journal`; +1 with `replay_file`": {1, 2, 3}}


def test_the_fd_carriers_are_marked_in_the_field_table() -> None:
    """Section 7 marks each message that carries fds with how many, as `fds_carried` counts
    them: `(+1 fd)`, `(+1 fd with `journal`)` (0 without), `(+1 fd; +1 with `journal`; +1
    with `replay_file`)`."""
    marked = {m["name"]: _FD_MARKS[m["mark"]] for m in re.finditer(
        r"^\| `(?P<name>\w+)` \((?P<mark>\+1 fd[^)]*)\)", doc_section(doc_text(), "7"), re.M)}
    counts: dict[str, set[int]] = {}
    for _, msg in EXAMPLES.values():
        counts.setdefault(str(msg.__struct_config__.tag), set()).add(protocol.fds_carried(msg))
    carriers = {tag: n for tag, n in counts.items() if n != {0}}
    assert set(marked) == set(carriers)
    assert all(carriers[tag] <= marked[tag] for tag in marked)
    # Every count of a message whose count depends on `journal` (and `replay_file`) is the
    # mark's, and the examples show one with each.
    journal = protocol.Journal(capacity=1, total=0, position=0)
    where = protocol.ReplayFile(offset=0, length=1)
    for cls in (protocol.Deposited, protocol.Handoff):
        tag = str(cls.__struct_config__.tag)
        example = next(m for _, m in EXAMPLES.values() if isinstance(m, cls))
        if cls is protocol.Handoff:
            every = {protocol.fds_carried(msgspec.structs.replace(example, journal=j,
                                                                  replay_file=r))
                     for j in (None, journal) for r in (None, where)}
            assert any(getattr(m, "replay_file", None) for _, m in EXAMPLES.values())
        else:
            every = {protocol.fds_carried(msgspec.structs.replace(example, journal=j))
                     for j in (None, journal)}
        assert marked[tag] == every


def test_the_states_are_the_codes() -> None:
    states = [cells[0].strip("`") for cells in table_rows(doc_section(doc_text(), "10.1"))
              if cells[0] != "state"]
    assert sorted(states) == sorted(typing.get_args(protocol.SessionState))


def test_the_error_codes_are_the_codes() -> None:
    codes = [cells[0].strip("`") for cells in table_rows(doc_section(doc_text(), "9"))
             if cells[0] != "code"]
    assert codes == list(typing.get_args(protocol.ErrorCode))


def test_the_name_rule_is_the_codes() -> None:
    assert f"`{protocol.NAME_CHARS[:-7]}`, 1 to 128 characters" in doc_text()
    assert protocol.NAME_CHARS.endswith("{1,128}")


def test_the_request_limit_is_the_codes() -> None:
    assert protocol.MAX_REQUEST_BYTES == 1_048_576
    assert "at most **1 MiB** (1 048 576 bytes" in doc_section(doc_text(), "2")


def test_the_batch_limit_is_the_codes() -> None:
    assert protocol.MAX_BATCH == 4096
    assert "1 to 4096 distinct ids" in doc_section(doc_text(), "12.7")


# --- section 10.6: the journal file --------------------------------------------------------------


def test_the_journal_file_header_is_the_holders() -> None:
    """The header listing of section 10.6 is the first 56 bytes of a journal file the holder
    makes for a ring of the default size, the rest of its first page is zeros, and its
    offsets, sizes and checksum are as described: the layout escrow_client.journal reads."""
    import zlib

    from escrow_client import journal
    from escrowd.journal import JournalFile
    from escrowd.ring import RingBudget

    shown = hex_bytes(dict(doc_blocks(doc_text(), "journal"))["header"])
    file = JournalFile.create(Config(socket_path="").ring_bytes, RingBudget(1 << 30))
    try:
        page = os.pread(file.fd, journal.DATA_OFFSET, 0)
        size = os.fstat(file.fd).st_size
    finally:
        file.close()
    head = page[: journal.TOTAL_OFFSET + 8 * journal.COUNTERS]
    assert shown == head
    assert page[len(head):] == bytes(journal.DATA_OFFSET - len(head))  # unused: zeros
    magic, version, crc, data_offset, data_size = journal.FIXED.unpack_from(head)
    assert (magic, version, journal.FIXED.size, journal.TOTAL_OFFSET) == (
        b"ESCROWJL", journal.LAYOUT_VERSION, 32, 32)
    assert (magic, version) == (journal.MAGIC, 2)
    assert (data_offset, data_size, size) == (
        journal.DATA_OFFSET, RING_BYTES, journal.DATA_OFFSET + RING_BYTES)
    assert crc == zlib.crc32(head[16:32], zlib.crc32(head[:12]))
    assert struct.unpack_from("=QQQ", head, journal.TOTAL_OFFSET) == (0, 0, 0)  # a fresh one
    section = doc_section(doc_text(), "10.6")
    assert f"{journal.MAX_WRITE} bytes" in section and journal.MAX_WRITE == 8192
    assert f"`{journal.DATA_OFFSET}`" in section and journal.DATA_OFFSET == 4096
    assert f"`{journal.MAGIC.decode()}` and the layout version `{version}`" in section
    assert f"{size:,} bytes long".replace(",", " ") in section.replace("\n", " ")
    # The header table: each field at the offset and with the size the code reads it.
    rows = {cells[2]: (int(cells[0]) if cells[0].isdigit() else cells[0], cells[1])
            for cells in table_rows(section) if cells[0] != "offset"}
    fixed = {"magic": "8s", "layout version, u32": "I", "checksum, u32": "I",
             "data offset, u64": "Q", "data size, u64": "Q"}
    assert "=" + "".join(fixed.values()) == journal.FIXED.format
    expected: dict[str, tuple[int | str, str]] = {}
    for name, code in fixed.items():
        at = struct.calcsize("=" + "".join(list(fixed.values())[: len(expected)]))
        expected[name] = (at, str(struct.calcsize("=" + code)))
    for i, name in enumerate(("total", "writing", "reading")[: journal.COUNTERS]):
        expected[f"`{name}`, u64"] = (journal.TOTAL_OFFSET + 8 * i, "8")
    end = journal.TOTAL_OFFSET + 8 * journal.COUNTERS
    expected[""] = (end, str(journal.DATA_OFFSET - end))
    expected["`data`"] = (journal.DATA_OFFSET, "data size")
    assert rows == expected


# --- section 13 and 4.4: this system's constants ------------------------------------------------

_LINUX_64 = sys.platform.startswith("linux") and platform.machine() in ("x86_64", "aarch64")


def linux_constants() -> dict[str, int | None]:
    out: dict[str, int | None] = {}
    for cells in table_rows(doc_section(doc_text(), "13")):
        if cells[0] == "name":
            continue
        out[cells[0].strip("`")] = None if cells[1] == "—" else int(cells[1], 0)
    return out


@pytest.mark.skipif(not _LINUX_64, reason="the table's Linux column is for x86_64 and aarch64")
def test_the_linux_constants_are_this_systems() -> None:
    import errno

    actual: dict[str, int | None] = {
        "AF_UNIX": socket.AF_UNIX, "SOCK_STREAM": socket.SOCK_STREAM,
        "SOCK_CLOEXEC": socket.SOCK_CLOEXEC, "SOCK_NONBLOCK": socket.SOCK_NONBLOCK,
        "SOL_SOCKET": socket.SOL_SOCKET, "SCM_RIGHTS": socket.SCM_RIGHTS,
        "MSG_NOSIGNAL": socket.MSG_NOSIGNAL, "SO_NOSIGPIPE": None,
        "MSG_CMSG_CLOEXEC": socket.MSG_CMSG_CLOEXEC, "MSG_CTRUNC": socket.MSG_CTRUNC,
        "SO_PEERCRED": socket.SO_PEERCRED, "LOCAL_PEERCRED": None, "LOCAL_PEERPID": None,
        "TIOCGPTN": escrow_platform._TIOCGPTN, "sun_path": 108,
        "FD_CLOEXEC": fcntl.FD_CLOEXEC, "F_SETFD": fcntl.F_SETFD, "F_SETFL": fcntl.F_SETFL,
        "O_NONBLOCK": os.O_NONBLOCK, "ENOENT": errno.ENOENT, "EIO": errno.EIO,
        "EAGAIN": errno.EAGAIN, "EPIPE": errno.EPIPE, "ECONNRESET": errno.ECONNRESET,
        "ECONNREFUSED": errno.ECONNREFUSED,
    }
    assert linux_constants() == actual


@pytest.mark.skipif(not _LINUX_64, reason="the layout shown is 64-bit Linux's")
def test_the_linux_control_message_layout_is_this_systems() -> None:
    """What CMSG_LEN, CMSG_SPACE and CMSG_DATA compute here, against section 4.4's listing
    (the C client's tests check it against the C macros too)."""
    shown = hex_bytes(dict(doc_blocks(doc_text(), "cmsg"))["linux-64"])
    assert (socket.CMSG_LEN(4), socket.CMSG_SPACE(4), socket.CMSG_SPACE(32)) == (20, 24, 48)
    header = struct.pack("=QiI", socket.CMSG_LEN(4), socket.SOL_SOCKET, socket.SCM_RIGHTS)
    expected = header + struct.pack("=i", 7)
    assert shown == expected + bytes(socket.CMSG_SPACE(4) - len(expected))


@pytest.mark.skipif(not _LINUX_64, reason="the layout shown is 64-bit Linux's")
def test_the_linux_two_fd_control_message_is_this_systems() -> None:
    """A handoff with a journal: the master, then the journal file, in one control message."""
    shown = hex_bytes(dict(doc_blocks(doc_text(), "cmsg"))["linux-64-two"])
    assert (socket.CMSG_LEN(8), socket.CMSG_SPACE(8)) == (24, 24)
    header = struct.pack("=QiI", socket.CMSG_LEN(8), socket.SOL_SOCKET, socket.SCM_RIGHTS)
    assert shown == header + struct.pack("=ii", 7, 9)


def test_the_macos_control_message_follows_its_formulas() -> None:
    shown = hex_bytes(dict(doc_blocks(doc_text(), "cmsg"))["macos"])
    assert shown == struct.pack("<IiIi", 16, 0xFFFF, 1, 7)


# --- regenerating ---------------------------------------------------------------------------------


def write() -> None:
    text = doc_text()
    for name in EXAMPLES:
        pattern = re.compile(rf"^<!-- frame: {name} -->\n```hex\n.*?^```$", re.M | re.S)
        text, count = pattern.subn(lambda _m, n=name: block(n), text)  # type: ignore[misc]
        if count != 1:
            raise SystemExit(f"PROTOCOL.md has {count} blocks for {name}, not 1")
    DOC.write_text(text, encoding="utf-8")
    VECTORS.mkdir(exist_ok=True)
    for stale in set(VECTORS.glob("*.json")) - {VECTORS / f"{n}.json" for n in EXAMPLES}:
        stale.unlink()
    for name in EXAMPLES:
        (VECTORS / f"{name}.json").write_text(vector_text(name), encoding="utf-8")


def _main() -> Iterator[str]:
    for name in EXAMPLES:
        yield block(name)


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write()
    else:
        for shown in _main():
            print(shown, end="\n\n")
