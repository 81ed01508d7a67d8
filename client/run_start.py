"""Starting a program through the holder (`start`, PROTOCOL.md section 12.9): the holder
forks it on a new PTY, so it is the program's parent and knows how it ended (`wait`,
escrow_client.program_wait), and hands the master to a custody as a retrieve into custody
does (docs/design.md §12, §16).

The program never runs as the app's child: it keeps running whatever becomes of the app,
and its exit status outlives the app (and, under the keeper, the holder). The handoff is
the retrieve path's (escrow_client.retrieve): complete only once acked; a handoff that
fails leaves the session draining with its program running.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from . import errors, protocol
from .channel import Deadline
from .custody import Custody
from .retrieve import retrieve_many_on
from .retrieved import Retrieved

FEATURE = "start"


def can_start(custody: Custody) -> bool:
    """Whether the custody's holder takes `start` (an older holder does not)."""
    return FEATURE in custody._usable_channel().welcome.features


def start(custody: Custody, session_id: str, argv: Sequence[str], *, cwd: str | None = None,
          env: Mapping[str, str] | None = None, label: str = "", cols: int = 0,
          rows: int = 0, meta: dict[str, str] | None = None,
          journal: bool = False, modes_of: int | None = None) -> Retrieved:
    """Have the holder start `argv` (from `cwd`, default this process's; with `env`,
    default this process's environment) on a new PTY of cols x rows as session
    `session_id`, held by `custody`, with the modes of terminal `modes_of` (its erase
    character, iutf8...) if given, as a terminal app gives a new tab the user's: the master
    is the caller's to read, as after `Custody.retrieve`. Raises SessionExists, CwdGone,
    ExecFailed, BadRequest (argv or env too big, a NUL in them), LimitReached as the holder
    answers, and EscrowConfigError if the holder does not take `start`; nothing is left
    running then."""
    request = protocol.Start(
        id=session_id, argv=list(argv), cwd=os.path.abspath(cwd or os.getcwd()),
        env=dict(os.environ if env is None else env), label=label, cols=cols, rows=rows,
        meta=meta or {}, journal=journal,
        modes=_modes(modes_of) if modes_of is not None else None)
    client = custody._client
    with custody._lock:
        channel = custody._usable_channel()
        if FEATURE not in channel.welcome.features:
            raise errors.EscrowConfigError(
                f"the holder on {channel.socket_path} does not start programs (it is older)")
        got, failed = retrieve_many_on(
            channel, [session_id], Deadline(client.timeout), True, journal,
            timeout=client.timeout, connect=client._connect, start=request)
        custody._keep_retrieved(got, journal)
    if session_id in failed:
        raise failed[session_id]
    return got[session_id]


def _modes(fd: int) -> protocol.Modes | None:
    """Terminal `fd`'s termios attributes, as `start` carries them (None if it has none)."""
    import termios

    try:
        iflag, oflag, cflag, lflag, ispeed, ospeed, cc = termios.tcgetattr(fd)
    except termios.error:
        return None
    return protocol.Modes(iflag=iflag, oflag=oflag, cflag=cflag, lflag=lflag, ispeed=ispeed,
                          ospeed=ospeed,
                          cc=[c if isinstance(c, int) else ord(c) for c in cc])
