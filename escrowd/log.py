"""One line per event on stderr, as key=value pairs.

Every line about a session carries `session=owner/id`; every state change carries its
`reason`. Values with spaces or quotes are quoted so a line splits back into its pairs with
`shlex.split`.
"""

from __future__ import annotations

import os
import select
import sys
import time


def _format(value: object) -> str:
    text = f"{value:.3f}" if isinstance(value, float) else str(value)
    if text == "" or any(c in text for c in " \"'=\\\n\t"):
        escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        return f'"{escaped}"'
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
    line = (" ".join(parts)[: _MAX_LINE - 1] + "\n").encode("utf-8", "replace")
    try:
        fd = sys.stderr.fileno()
        if not _poller(fd).poll(0):
            dropped_lines += 1
            return
        os.write(fd, line)
        dropped_lines = 0
    except (OSError, ValueError, AttributeError):
        pass  # a closed or broken stderr must not take the holder down


_pollers: dict[int, select.poll] = {}


def _poller(fd: int) -> select.poll:
    poller = _pollers.get(fd)
    if poller is None:
        poller = _pollers[fd] = select.poll()
        poller.register(fd, select.POLLOUT)
    return poller
