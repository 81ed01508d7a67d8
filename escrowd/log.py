"""One line per event on stderr, as key=value pairs.

Every line about a session carries `session=owner/id`; every state change carries its
`reason`. Values with spaces or quotes are quoted so a line splits back into its pairs with
`shlex.split`.
"""

from __future__ import annotations

import os
import re
import select
import sys
import time

_MAX_VALUE = 1000  # characters of one value; a longer one is cut and marked with "..."


# Characters a client could use to steer a reader of the log: line breaks (a forged line),
# C0 and C1 controls (ESC and CSI recolour or clear a terminal showing a foreground
# holder), and invisible format characters (bidi overrides reorder what is shown).
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff]")
_NAMED = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _escape_char(match: re.Match[str]) -> str:
    c = match.group()
    return _NAMED.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")


def _format(value: object) -> str:
    """One value, safe to print: quoted (so that `shlex.split` gives it back) when it holds
    a space, a quote, `=` or a backslash, and with every unsafe character written as an
    escape (`\\n`, `\\x1b`, `\\u202e`), never as itself."""
    text = f"{value:.3f}" if isinstance(value, float) else str(value)
    if len(text) > _MAX_VALUE:
        text = text[: _MAX_VALUE - 3] + "..."
    if text == "" or _UNSAFE.search(text) or any(c in text for c in " \"'=\\"):
        escaped = text.replace("\\", "\\\\").replace('"', '\\"')
        return '"' + _UNSAFE.sub(_escape_char, escaped) + '"'
    return text


_MAX_LINE = 4000  # under PIPE_BUF (4096): a write of one line into a pipe is all or nothing
dropped_lines = 0


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
    try:
        fd = sys.stderr.fileno()
        if not _poller(fd).poll(0):
            dropped_lines += 1
            return
        os.write(fd, line)
        dropped_lines = 0
    except (OSError, ValueError, AttributeError):
        pass  # a closed or broken stderr must not take the holder down


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
