"""Wait for a process to exit, without polling: a pidfd on Linux, a kqueue NOTE_EXIT on macOS.

The holder uses it for a `held` session it adopted (docs/design.md §11): the app that held custody
is still running, but its connection went with the old holder. The session stays held while
that process lives and starts draining the moment there is positive proof that it died:
on Linux, a pidfd that turns readable (the whole process has exited, not only its main
thread), or a process of another start time under that pid.
"""

from __future__ import annotations

import os
import select
import sys

import trio

from escrow_client.liveness import process_alive, started_otherwise

_FALLBACK_PERIOD = 5.0  # seconds between looks when no pidfd can be opened


async def wait_exit(pid: int, start_time: float | None) -> None:
    """Return once process `pid` (the one that started at `start_time`, when known) has
    exited; at once if it already has, or another process has its pid now.

    Cancellation: safe at any point; nothing is left registered or open.
    """
    if sys.platform == "linux":
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            return
        except (OSError, ValueError, OverflowError):
            # Out of fds, say (or a pid no pidfd can be opened for): ask now and then
            # instead. Never a crash of the holder.
            while process_alive(pid, start_time) is not False:
                await trio.sleep(_FALLBACK_PERIOD)
            return
        try:
            # Opened first, checked second: the pid cannot be reused under an open pidfd.
            # From here only the pidfd proves death: it turns readable once the whole
            # thread group has exited, whereas /proc shows `Z` as soon as the main thread
            # has (a process serving from another thread is alive). /proc is asked only
            # whether this is the process we watch at all.
            if started_otherwise(pid, start_time):
                return
            await trio.lowlevel.wait_readable(pidfd)
        finally:
            trio.lowlevel.notify_closing(pidfd)
            os.close(pidfd)
        return
    if sys.platform == "darwin":
        kqueue = trio.lowlevel.current_kqueue()
        event = select.kevent(pid, filter=select.KQ_FILTER_PROC,
                              flags=select.KQ_EV_ADD | select.KQ_EV_ONESHOT,
                              fflags=select.KQ_NOTE_EXIT)
        with trio.lowlevel.monitor_kevent(pid, select.KQ_FILTER_PROC) as events:
            try:
                kqueue.control([event], 0)
            except ProcessLookupError:
                return
            if process_alive(pid, start_time) is False:
                return
            await events.receive()
        return
    raise OSError("no way to watch a process exit on this platform")
