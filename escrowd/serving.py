"""The holder's life in its event loop, from the socket claimed to the stop: what
`escrowd --bare` (and a keeper's holder) runs once its arguments are read and the fds it
was passed are taken (escrowd.__main__), whether it was started by exec or was a keeper's
standby told to serve (escrowd.takeover).

It is apart from escrowd.__main__ so that the command's first imports stay light: the keeper
(`escrowd` without `--bare`) runs no event loop, and loads neither trio nor the holder's
modules. `serve` runs trio: the holder serves on the socket, adopts what the store passed,
reports ready, pings the watchdog, watches for SIGTERM (and, with no keeper, SIGINT), and
serves on alone if its keeper dies.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket

import trio

from . import __version__
from .config import Config
from .fdstore import FDS_PER_SESSION, FdStore
from .lifecycle import StartupError, claimed, take_lock
from .log import log
from .pidwatch import wait_exit
from .server import Holder
from .service import Passed, keep_watchdog, notify, status_line, watchdog_interval


def serve(config: Config, passed: Passed, keeper_pid: int | None,
          channel: socket.socket | None, explicit_cap: bool) -> None:
    """Run the holder until it stops (StartupError if it cannot start)."""
    trio.run(_run, config, passed, keeper_pid, channel, explicit_cap)


async def _run(config: Config, passed: Passed, keeper_pid: int | None,
               channel: socket.socket | None, explicit_cap: bool) -> None:
    with claimed(config.socket_path, passed.listener, keeper_pid is not None) as listening:
        listener = trio.socket.from_stdlib_socket(listening)
        store = FdStore(os.environ.get("NOTIFY_SOCKET"), channel)
        config = _fit_store(config, store, explicit_cap)
        holder = Holder(config, store, keeper_pid)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_watch_signals, holder)
                if keeper_pid is not None:
                    nursery.start_soon(_outlive_keeper, holder, keeper_pid)
                await nursery.start(_serve_then_stop, holder, listener, passed.stored,
                                    nursery.cancel_scope)
                log("ready", socket=config.socket_path, pid=os.getpid(), version=__version__,
                    instance=holder.instance, fd_store=holder.store_kind)
                ready_status = _status(holder)
                notify(f"READY=1\nMAINPID={os.getpid()}\nSTATUS={ready_status}")
                interval = watchdog_interval()
                if interval is not None:
                    log("watchdog", interval=interval)
                    nursery.start_soon(keep_watchdog, interval, lambda: _status(holder),
                                       ready_status)
        finally:
            store.close()


def _fit_store(config: Config, store: FdStore, explicit_cap: bool) -> Config:
    """The session cap the store can hold ($FDSTORE, as systemd 254 and the keeper say it):
    past it, sessions would be answered `deposited` and lost at the next restart (systemd
    drops what does not fit, and says so only in its journal). A cap the user gave
    (`explicit_cap`) that does not fit is refused at start; the default is lowered to fit,
    and says so."""
    room = os.environ.pop("FDSTORE", "")
    if not store.enabled or not room.isdigit():
        return config
    needed = config.max_sessions * FDS_PER_SESSION + 1
    if needed <= int(room):
        return config
    if explicit_cap:
        raise StartupError(
            f"the fd store holds {room} fds, and --max-sessions {config.max_sessions} needs "
            f"{needed} ({FDS_PER_SESSION} a session, and the holder's own): lower "
            "--max-sessions, or raise FileDescriptorStoreMax= in the unit (escrowctl "
            "install-service sizes it) or the keeper's fd limit")
    fits = max(0, (int(room) - 1) // FDS_PER_SESSION)
    log("limit", max_sessions=fits, reason=f"the fd store holds {room} fds: the default of "
        f"{config.max_sessions} sessions does not fit")
    return dataclasses.replace(config, max_sessions=fits)


def _status(holder: Holder) -> str:
    return status_line(holder.config.socket_path, holder.registry.count_by_state())


def _stopping(holder: Holder, reason: str) -> None:
    log("stopping", reason=reason)
    notify(f"STOPPING=1\nSTATUS=stopping on {reason}; was {_status(holder)}")


async def _serve_then_stop(
    holder: Holder,
    listener: trio.socket.SocketType,
    stored: dict[str, list[int]],
    scope: trio.CancelScope,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    await holder.serve(listener, stored, task_status=task_status)
    if holder.idle_exited:
        _stopping(holder, "idle exit")
    scope.cancel()  # stop watching signals and pinging the watchdog too


async def _outlive_keeper(holder: Holder, keeper_pid: int) -> None:
    """The keeper died (its fds, and every stored session's, with it): serve on alone. The
    holder takes the lock, so no second escrowd starts on this path, and answers deposits
    without a store: its sessions live as long as it does."""
    await wait_exit(keeper_pid, None)
    holder.store.close()
    holder.keeper_pid, holder.store_kind = None, "none"
    try:
        holder.lock_fd = take_lock(holder.config.socket_path)
    except StartupError as exc:
        log("keeper_gone", keeper_pid=keeper_pid, reason=f"serving on without a store; {exc}")
        return
    log("keeper_gone", keeper_pid=keeper_pid,
        reason="serving on alone, without a store: sessions now die with this holder")


async def _watch_signals(holder: Holder) -> None:
    """SIGTERM (or, with no keeper, SIGINT): stop in order (Holder.serve), keeping every
    stored session for the next holder; whoever keeps the store (systemd, the keeper)
    decides what is next. Under a keeper SIGINT is the keeper's to judge (Ctrl-C in its
    terminal reaches both): ignored here."""
    stop_on = (signal.SIGTERM,) if holder.keeper_pid else (signal.SIGTERM, signal.SIGINT)
    with trio.open_signal_receiver(*stop_on) as signals:
        async for signum in signals:
            if holder.stopping:
                continue  # stopping in order already: a second signal must not cut it short
            _stopping(holder, signal.Signals(signum).name)
            holder.request_stop()


