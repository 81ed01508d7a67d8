"""One line per event on stderr, as key=value pairs.

Every line about a session carries `session=owner/id`; every state change carries its
`reason`. Values with spaces or quotes are quoted so a line splits back into its pairs with
`shlex.split`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import select
import sys
import time
import unicodedata
from collections.abc import Iterator

_MAX_VALUE = 1000  # characters of one value as written; a longer one is cut, ending "..."


# Characters a client could use to steer a reader of the log: line breaks (a forged line),
# C0 and C1 controls (ESC and CSI recolour or clear a terminal showing a foreground
# holder), invisible format characters (bidi overrides reorder what is shown), and spaces
# other than the space (a value would look like two).
_UNSAFE_CATEGORIES = {"Cc", "Cf", "Co", "Cs", "Cn", "Zl", "Zp", "Zs"}
_NAMED = {"\n": "\\n", "\t": "\\t", "\r": "\\r", "\\": "\\\\", '"': '\\"'}
_PLAIN = re.compile(r"[A-Za-z0-9._:@/+,%()-]+")
# Printable ASCII but the quote and the backslash: safe inside quotes as it is.
_QUOTABLE = re.compile(r"[ !#-\[\]-~]*")


def _escape(c: str) -> str:
    named = _NAMED.get(c)
    if named is not None:
        return named
    if c != " " and (c < " " or "\x7f" <= c < "\xa0"
                     or (c >= "\xa0" and unicodedata.category(c) in _UNSAFE_CATEGORIES)):
        n = ord(c)
        return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"
    return c


def _format(value: object) -> str:
    """One value, safe to print: as it is when it is plain; else quoted (so that
    `shlex.split` gives it back) with every unsafe character written as an escape (`\\n`,
    `\\x1b`, `\\u202e`), never as itself. At most _MAX_VALUE characters, escapes
    included; a longer one is cut (between escapes) and ends in "..."."""
    text = f"{value:.3f}" if isinstance(value, float) else str(value)
    if len(text) <= _MAX_VALUE and _PLAIN.fullmatch(text):
        return text
    if len(text) <= _MAX_VALUE - 2 and _QUOTABLE.fullmatch(text):
        return f'"{text}"'  # (most reasons: words and spaces, no escape needed)
    parts: list[str] = []
    room = _MAX_VALUE
    for c in text[:_MAX_VALUE]:
        escaped = _escape(c)
        room -= len(escaped)
        if room < 3:
            parts.append("...")
            break
        parts.append(escaped)
    return '"' + "".join(parts) + '"'


_MAX_LINE = 4000  # under PIPE_BUF (4096): a write of one line into a pipe is all or nothing
dropped_lines = 0
_batch: list[bytes] | None = None  # lines held back by `batched`


def log(event: str, **fields: object) -> None:
    """Write one line, or drop it (and count it) if stderr cannot take it right now.

    The holder never blocks on its log: a pipe that nobody reads, or a slow terminal, must
    not stop it from draining every session. poll() with no timeout says whether a write of
    at most PIPE_BUF bytes would block; O_NONBLOCK is not set on stderr because its open
    file description is shared with whoever started us.
    """
    global dropped_lines
    parts = [f"ts={time.time():.3f}", f"event={event}"]
    if dropped_lines:
        parts.append(f"log_lines_dropped={dropped_lines}")
    parts += [f"{key}={_format(value)}" for key, value in fields.items() if value is not None]
    if sum(len(p) + 1 for p in parts) > _MAX_LINE:
        parts = _whole_fields(parts, _MAX_LINE - len(" truncated=1")) + ["truncated=1"]
    line = (" ".join(parts) + "\n").encode("utf-8", "replace")
    if _batch is not None:
        _batch.append(line)
    else:
        _write(line, 1)


@contextlib.contextmanager
def batched() -> Iterator[None]:
    """Hold back the lines logged inside, and write them at the end, as many whole lines
    per write as fit under PIPE_BUF: a handoff of a thousand sessions logs two thousand
    lines, and a system call for each was a fifth of its time. (Not across an await: the
    lines of other tasks would wait too.)"""
    global _batch
    if _batch is not None:
        yield
        return
    lines: list[bytes] = []
    _batch = lines
    try:
        yield
    finally:
        _batch = None
        chunk: list[bytes] = []
        size = 0
        for line in lines:
            if chunk and size + len(line) > _MAX_LINE:
                _write(b"".join(chunk), len(chunk))
                chunk, size = [], 0
            chunk.append(line)
            size += len(line)
        if chunk:
            _write(b"".join(chunk), len(chunk))


_fallback: str | None = None  # where the log goes once stderr is gone (falls_back_to)
# stderr is gone for good: the terminal hung up, the pipe's reader went, or it was closed.
_GONE = {errno.EIO, errno.EPIPE, errno.EBADF, errno.ENXIO}


def falls_back_to(path: str) -> None:
    """Once stderr is gone for good (the terminal a foreground escrowd ran in was closed),
    log to `path` instead (created 0600, appended to, never through a symlink)."""
    global _fallback
    _fallback = path


def _write(lines: bytes, count: int) -> None:
    """Write `count` whole lines (at most PIPE_BUF bytes), or drop them if stderr cannot
    take them right now."""
    global dropped_lines
    try:
        fd = sys.stderr.fileno()
        if not _poller(fd).poll(0):
            dropped_lines += count
            return
        os.write(fd, lines)
        dropped_lines = 0
    except OSError as exc:
        if exc.errno in _GONE and _switch_to_fallback():
            _write(lines, count)
    except (ValueError, AttributeError):
        pass  # a closed or broken stderr must not take the holder down


def _switch_to_fallback() -> bool:
    """Put the fallback file where stderr was (fd 2: a holder started from here inherits
    it too). False if there is none, or it cannot be opened: then lines are dropped."""
    global _fallback
    path, _fallback = _fallback, None  # once: a file that fails too is not tried again
    if path is None:
        return False
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
    except OSError:
        return False
    try:
        os.dup2(fd, 2, inheritable=True)
    finally:
        os.close(fd)
    _pollers.pop(2, None)
    return True


def _whole_fields(parts: list[str], room: int) -> list[str]:
    """The leading fields that fit in `room` characters: a line is cut between fields,
    never inside a quoted value (which would no longer split back into pairs)."""
    kept: list[str] = []
    for part in parts:
        room -= len(part) + 1
        if room < 0:
            break
        kept.append(part)
    return kept


_pollers: dict[int, select.poll] = {}


def _poller(fd: int) -> select.poll:
    poller = _pollers.get(fd)
    if poller is None:
        poller = _pollers[fd] = select.poll()
        poller.register(fd, select.POLLOUT)
    return poller
