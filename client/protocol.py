"""The fd-escrow wire protocol: every message, and how it is framed.

This module is the single definition of the protocol, shared by the holder (`escrowd`) and
the client library. It does no I/O and imports no event loop; PROTOCOL.md describes the same
thing for implementers in other languages.

A frame is a 4-byte big-endian unsigned length followed by a MessagePack map. Every map has
a ``type`` field naming the message. Unknown fields are ignored (so new fields can be added
with defaults); an unknown ``type`` is an error. Exactly two messages carry an fd as
SCM_RIGHTS data on the first byte of their frame: ``deposit`` and ``handoff`` carry a PTY
master; ``deposited`` and ``handoff`` also carry the session's journal file when they
answer a request for a journal, and ``handoff`` its replay file when it answers a request
for replays by reference (`fds_carried` says how many a message must have).
"""

from __future__ import annotations

import struct
from typing import Annotated, Any, Literal

import msgspec

from .protocol_programs import MAX_ARGS as MAX_ARGS
from .protocol_programs import MAX_ENV as MAX_ENV
from .protocol_programs import Arg as Arg
from .protocol_programs import EnvName as EnvName
from .protocol_programs import ExitStatus as ExitStatus
from .protocol_programs import Modes as Modes
from .protocol_programs import ProgramEnd as ProgramEnd

VERSION = 1
SUPPORTED_VERSIONS = (1,)

HEADER = struct.Struct(">I")
MAX_REQUEST_BYTES = 1 << 20  # a request body, holder side

NAME_CHARS = r"[A-Za-z0-9._:@-]{1,128}"
# \A and \Z, not ^ and $: "$" also matches before a final newline, so "tab-1\n" would pass
# and be a second, different session that prints the same.
NAME_PATTERN = rf"\A{NAME_CHARS}\Z"
Name = Annotated[str, msgspec.Meta(pattern=NAME_PATTERN)]
Label = Annotated[str, msgspec.Meta(max_length=256)]
Pid = Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]
Dim = Annotated[int, msgspec.Meta(ge=0, le=65535)]
# An app's own notes on a session (cwd, title...): small, since the holder keeps it per session.
Meta = Annotated[
    dict[
        Annotated[str, msgspec.Meta(max_length=64)],
        Annotated[str, msgspec.Meta(max_length=1024)],
    ],
    msgspec.Meta(max_length=32),
]

SessionState = Literal[
    "held", "draining", "handing_off", "exited", "handed_off", "released", "expired", "unknown"
]
LIVE_STATES: frozenset[str] = frozenset({"held", "draining", "handing_off", "exited"})
TOMBSTONE_STATES: frozenset[str] = frozenset({"handed_off", "released", "expired"})

ErrorCode = Literal[
    "bad_request",
    "unsupported_version",
    "forbidden",
    "unknown",
    "exists",
    "not_a_terminal",
    "custody_held",
    "busy",
    "drain_stop_timeout",
    "limit",
    "handed_off",
    "released",
    "expired",
    "ack_late",
    "cwd_gone",
    "exec_failed",
    "not_a_program",
]


class Message(msgspec.Struct, tag_field="type", kw_only=True):
    """Base of every message; the tag (``type``) is the snake_case name given per class."""


# --- client to holder -------------------------------------------------------------------


class Hello(Message, tag="hello"):
    """First message on every connection. `timeout` is the client's deadline for one call,
    so the holder can wait at least that long for an ack."""

    version: int
    owner: Name
    client: Label = ""
    timeout: float | None = None


class Deposit(Message, tag="deposit"):
    """Carries the PTY master as SCM_RIGHTS. The sending connection becomes its custodian.
    `journal`: the app will record what it reads into a journal (docs/design.md §12);
    `deposited` then carries the journal file."""

    id: Name
    label: Label = ""
    child_pid: Pid | None = None
    cols: Dim = 0
    rows: Dim = 0
    meta: Meta = {}
    journal: bool = False


class Release(Message, tag="release"):
    id: Name


class Retrieve(Message, tag="retrieve"):
    """`keep`: after the ack the session stays escrowed, held by this connection (retrieve
    into custody). `journal` (only with `keep`): the app goes on recording into a journal,
    and `handoff` also carries the journal file."""

    id: Name
    keep: bool = False
    journal: bool = False
    # The client reads a replay from a file the holder sends (`Handoff.replay_file`) rather
    # than from the frame: asked only of a holder whose `features` has "replay_file".
    replay_file: bool = False


# How many sessions one retrieve_many may name.
MAX_BATCH = 4096


class RetrieveMany(Message, tag="retrieve_many"):
    """Retrieve several sessions at once: one answer per id (`handoff` or `error` with
    that id, in any order); then the client acks the handoffs it takes, each answered
    `done`. The ids must be distinct."""

    ids: Annotated[list[Name], msgspec.Meta(min_length=1, max_length=MAX_BATCH)]
    keep: bool = False
    journal: bool = False
    replay_file: bool = False


class Update(Message, tag="update"):
    """The app's session changed size or meta: what is given replaces what was recorded."""

    id: Name
    cols: Dim | None = None
    rows: Dim | None = None
    meta: Meta | None = None


class Ack(Message, tag="ack"):
    """`keep` repeats the retrieve's: it matters only for an ack sent on a new connection
    (the holder restarted mid-handoff), which then becomes the custodian."""

    id: Name
    handoff_id: str
    keep: bool = False


class AckMany(Message, tag="ack_many"):
    """The acks of every handoff of a `retrieve_many`, in one message (id: handoff_id),
    answered by one `done_many`."""

    acks: Annotated[dict[Name, str], msgspec.Meta(min_length=1, max_length=MAX_BATCH)]
    keep: bool = False


class Start(Message, tag="start"):
    """The holder starts `argv` on a new PTY of its own (it is the program's parent, and so
    knows its exit status), registers it as session `id`, and hands the master to this
    connection as a retrieve into custody does: answered `handoff`, then `ack{keep}` and
    `done` (PROTOCOL.md section 12.9). `cwd` must be absolute; `env` is the program's whole
    environment. Asked only of a holder whose `features` has "start"."""

    id: Name
    argv: Annotated[list[Arg], msgspec.Meta(min_length=1, max_length=MAX_ARGS)]
    cwd: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)] = "/"
    env: Annotated[dict[EnvName, Arg], msgspec.Meta(max_length=MAX_ENV)] = {}
    label: Label = ""
    cols: Dim = 0
    rows: Dim = 0
    meta: Meta = {}
    journal: bool = False
    # The PTY's modes (the asking terminal's); None: the PTY's own defaults.
    modes: Modes | None = None


class Wait(Message, tag="wait"):
    """Answered `waited` once the program of session `id`, one the holder started, has
    ended (at once if it has): the only request a holder may leave unanswered for long."""

    id: Name


class List(Message, tag="list"):
    all_owners: bool = False


class Status(Message, tag="status"):
    pass


Request = (Hello | Deposit | Release | Retrieve | RetrieveMany | Update | Ack | AckMany | List
           | Status | Start | Wait)


# --- holder to client -------------------------------------------------------------------


class SessionInfo(msgspec.Struct, kw_only=True):
    """What the holder knows about one session. `child_alive` is true, false or None
    (cannot tell); None is never rounded to false."""

    owner: str
    id: str
    label: str = ""
    state: SessionState
    child_pid: int | None = None
    child_alive: bool | None = None
    deposited_at: float = 0.0
    state_since: float = 0.0
    buffered_bytes: int = 0
    dropped_bytes: int = 0
    custodian_pid: int | None = None
    handoff_id: str | None = None
    cols: int = 0
    rows: int = 0
    meta: dict[str, str] = {}
    # After a holder's unclean stop: the offset in the replay where at most one read of
    # output may be missing (the newest such spot). None: the replay is seamless.
    replay_gap_at: int | None = None
    # Every such spot still in the replay, oldest first (one per unclean stop).
    replay_gaps: list[int] = []
    # The holder started its program (`start`): `exit_status` tells how it ended.
    started: bool = False
    exit_status: ProgramEnd = None


# What this holder does beyond the first version-1 holders: a client checks before it
# relies on one (an older holder ignores `keep`, and would hand the session off for good).
FEATURES = ("keep", "retrieve_many", "journal", "update", "journal_reading", "modes",
            "replay_file", "start")


class Welcome(Message, tag="welcome"):
    version: int
    holder_version: str
    pid: int
    drain_stop_budget: float
    send_deadline: float
    ack_deadline: float
    limits: dict[str, int] = {}
    features: list[str] = []


class Journal(msgspec.Struct, kw_only=True):
    """Where the app writes in the journal file's ring (escrow_client.journal, docs/design.md §12):
    the ring's `capacity` in bytes, and the `position` in its data area where the byte
    counted as number `total` goes (the file's counter then said `total`)."""

    capacity: int
    total: int
    position: int


class ReplayFile(msgspec.Struct, kw_only=True):
    """Where a handoff's replay is in its replay file (PROTOCOL.md section 12.8): `length`
    bytes from byte `offset`. The file is sealed: nobody can write, grow or shrink it."""

    offset: int
    length: int


class Deposited(Message, tag="deposited"):
    """`journal` is set when the deposit asked for one and the holder granted it: then the
    journal file rides on this message."""

    id: str
    journal: Journal | None = None


class Updated(Message, tag="updated"):
    id: str


class Released(Message, tag="released"):
    id: str


class Handoff(Message, tag="handoff"):
    """Carries the PTY master back as SCM_RIGHTS, with the output drained meanwhile."""

    handoff_id: str
    session: SessionInfo
    replay: bytes
    dropped_bytes: int = 0
    # Cut from the start of a replay whose ring wrapped, so it starts outside an escape
    # sequence and a UTF-8 character (counted apart from `dropped_bytes`).
    replay_trimmed: int = 0
    # How many bytes of `replay` the app recorded (a journal), not the holder.
    replay_journaled: int = 0
    # With retrieve{keep, journal}: where the app goes on writing; the journal file is the
    # second fd.
    journal: Journal | None = None
    # The terminal modes (the alternate screen, a hidden cursor...) that a preamble of
    # `replay_preamble` bytes at the start of `replay` sets, because the bytes that set them
    # are no longer in it: names, in its order (PROTOCOL.md section 12.2).
    restored_modes: list[str] = []
    replay_preamble: int = 0
    # Only to a retrieve that asked for `replay_file`: `replay` is empty, and the replay is
    # in the file that is the last fd, where this says. Nil: the replay is `replay`.
    replay_file: ReplayFile | None = None


class Done(Message, tag="done"):
    id: str


class DoneMany(Message, tag="done_many"):
    ids: list[str]


class Waited(Message, tag="waited"):
    """The program of session `id` has ended, so: an ExitStatus or "unknown"."""

    id: str
    exit_status: ExitStatus | Literal["unknown"]


class Sessions(Message, tag="sessions"):
    sessions: list[SessionInfo]


class HolderStatus(Message, tag="holder_status"):
    pid: int
    version: str
    started_at: float
    socket: str
    sessions_by_state: dict[str, int] = {}
    counters: dict[str, int] = {}
    limits: dict[str, int] = {}
    open_fds: int | None = None
    rss_bytes: int | None = None
    # Surviving the holder (docs/design.md §11): this holder process, who keeps the fds while no
    # holder runs ("systemd", "keeper" or "none"), and what it found at start.
    instance: str = ""
    fd_store: str = "none"
    keeper_pid: int | None = None
    adopted: int = 0
    # None: unknown (the count itself was lost: a "no restart" would be a lie).
    restarts: int | None = 0
    unclean_restarts: int | None = 0
    # Of the sessions adopted, those whose record could not be believed (adopted with a
    # fresh ring, their replay marked lost: see section 10.4), and those renamed because
    # another claimed the same owner/id.
    adopted_without_record: int = 0
    adopted_renamed: int = 0


class Error(Message, tag="error"):
    """`versions` is set only in `unsupported_version`: the protocol versions the holder
    speaks, so a client can choose one without parsing `message`."""

    code: str
    message: str
    id: str | None = None
    versions: list[int] | None = None


Response = (Welcome | Deposited | Released | Handoff | Done | DoneMany | Sessions
            | HolderStatus | Updated | Waited | Error)

# Which messages carry a PTY master; every other message carries none, except a
# `deposited` with a journal (the state file).
FD_CARRIERS: tuple[type[Message], ...] = (Deposit, Handoff)


def fds_carried(message: Message) -> int:
    """How many fds `message` must come with: the PTY master of a deposit or handoff,
    the journal file of a granted journal, and a handoff's replay file."""
    count = 1 if isinstance(message, FD_CARRIERS) else 0
    if isinstance(message, Deposited | Handoff) and message.journal is not None:
        count += 1
    if isinstance(message, Handoff) and message.replay_file is not None:
        count += 1
    return count


class ProtocolError(Exception):
    """The peer sent something that is not a valid frame or message. The connection is not
    usable after this; `code` is the protocol error code to answer with where one can."""

    code = "bad_request"


class FrameError(ProtocolError):
    """The framing itself is broken (a bad length, a frame cut short, truncated ancillary
    data): the stream is out of step and the connection must end."""


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_response_decoder = msgspec.msgpack.Decoder(Response)


def encode(message: Message) -> bytes:
    """Return the whole frame (header and body) for `message`."""
    body = _encoder.encode(message)
    return HEADER.pack(len(body)) + body


def decode_request(body: bytes | memoryview) -> Request:
    return _decode(_request_decoder, body)  # type: ignore[no-any-return]


def decode_response(body: bytes | memoryview) -> Response:
    return _decode(_response_decoder, body)  # type: ignore[no-any-return]


def _decode(decoder: msgspec.msgpack.Decoder[Any], body: bytes | memoryview) -> Any:
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"invalid message: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"undecodable MessagePack: {exc}") from None
    except RecursionError:
        # msgspec raises this (not DecodeError) for containers nested past its depth limit,
        # even inside a field it would skip: still just a bad body from the peer.
        raise ProtocolError("undecodable MessagePack: nested too deeply") from None


def check_fds(message: Message, fd_count: int) -> None:
    """Raise ProtocolError unless `message` came with the number of fds it must carry."""
    wanted = fds_carried(message)
    if fd_count != wanted:
        name = type(message).__struct_config__.tag
        raise ProtocolError(f"a {name} frame must carry {wanted} fd(s), not {fd_count}")


def parse_header(header: bytes, max_body: int) -> int:
    """Return the body length from a 4-byte header, refusing bodies over `max_body`."""
    (length,) = HEADER.unpack(header)
    if length == 0:
        raise FrameError("empty frame")
    if length > max_body:
        raise FrameError(f"frame of {length} bytes is over the limit of {max_body}")
    return int(length)
