"""The keeper: what `escrowd` runs by default (scripts/holder, autostart, launchd), so that
the escrow outlives the holder where systemd does not keep it (docs/design.md §11).

The keeper takes the lock, binds the socket, and runs the holder (`escrowd --bare`) as its
child, speaking to it the subset of systemd's protocol the holder already speaks:
`LISTEN_FDS`/`LISTEN_FDNAMES` on start (the listening socket first, then every stored fd),
and the messages READY, STATUS, WATCHDOG, STOPPING, FDSTORE (with FDNAME; FDPOLL is moot,
the keeper never polls a stored fd) and FDSTOREREMOVE. It restarts a holder that dies, with
back-off, and closes a stored fd only on FDSTOREREMOVE or when it stops. Connections made
while no holder runs wait in the listen backlog.

The messages travel over a datagram socketpair made for each holder it starts (the holder
inherits one end, `ESCROWD_NOTIFY_FD`), never over a path: nothing a user or a tmp cleaner
does to a file can cut a healthy holder off from its store (a removed notify socket once
made the keeper kill its holder for a missed watchdog, and the next one ran with no store),
and no other process can reach the keeper. Unlike systemd, the keeper answers every
FDSTORE: `ESCROWD_STORED=<n>` once the fds are in its store, or `ESCROWD_STORE_FAILED=<n>`
(at its fd limit, the kernel drops fds from the message: MSG_CTRUNC), so the holder answers
`deposited` only for fds that are really safe here. `FDSTORE=<n>` in the holder's
environment says how many fds the store can take, as systemd 254 says it.

It has no event loop library and no session logic, so that it is small enough to trust:
one `poll` over the holder's channel and a self-pipe for signals. The channel's messages
and answers are escrowd.notify; the fork and exec of a holder, escrowd.spawn. Once a holder
is ready, the keeper keeps the next one loaded and waiting (escrowd.standby), which takes
over the moment the serving holder is reaped; whatever goes wrong with it, a holder is
exec'd instead, as before.

Orphans: on Linux the keeper is the child subreaper, so a program its holder started and
left behind by dying becomes the keeper's child; it keeps the orphan's exit status for the
next holder, then reaps it (escrowd.orphans). It never reaps its own holders, standbys or
trial runs there.

Signals: SIGTERM stops the holder, then the keeper, and closes every stored fd (the
terminals no app holds hang up: this is `escrowctl stop --force`). SIGINT (Ctrl-C in the
terminal a foreground escrowd runs in) does the same only while no session is stored:
with sessions it keeps them all, and says how to stop for real (an interrupt once dropped
every session without a word, while `escrowctl stop` refused the same without --force).
Its holder ignores SIGINT. If that terminal goes away, the log goes on in `<socket>.log`
(escrowd.log); the hangup its shell may pass on is no upgrade. SIGHUP replaces the holder
with the installed code (`escrowctl upgrade`): the new code is tried first, the old holder
stops in order, the new one adopts every session; if the new one fails, the fds stay here
and it is retried with back-off. Every holder and trial run is started from `/` and
isolated from the caller's environment (escrow_client.interpreter).
"""

from __future__ import annotations

import contextlib
import os
import resource
import select
import signal
import socket
import stat
import sys
import time

from escrow_client import paths
from escrow_client.fdpass import close_fds
from escrow_client.interpreter import python_command
from escrow_client.processes import become_subreaper

from . import orphans
from .config import Config
from .lifecycle import StartupError, bind_socket, remove_leftover_socket, take_lock
from .log import log
from .names import SESSION_PREFIX
from .notify import channel_pair, read_notifications
from .spawn import fork_holder
from .standby import Standbys
from .trial import TrialRun

KEEPER_ENV = "ESCROWD_KEEPER_PID"  # tells the holder who keeps its fds (its parent)
LISTENER_NAME = "escrowd.socket"  # as systemd names a .socket unit's fd
WATCHDOG_SECONDS = 30.0  # a holder whose event loop does not ping for this long is killed
STOP_GRACE = 20.0  # a stopping holder gets this long before SIGKILL
# A started holder (exec'd, or a standby sent its takeover) that is not READY this long after
# is killed, and the next one exec'd. Adoption comes before READY: 10,000 sessions take a
# holder about 3 s (a cold restart with 1,000 is 0.3 s, docs/performance.md), and a loaded
# machine can be ten times slower; a holder frozen (SIGSTOP, a freezer) would otherwise hang the
# escrow for good, every connection waiting in the backlog. The watchdog's figure too: a
# ready holder whose loop stalls this long is killed just the same.
_BACKOFF_FIRST, _BACKOFF_MAX, _STABLE = 0.1, 5.0, 10.0
_RESTARTS_AT_ONCE = 10  # within _STABLE seconds: more than this is a crash loop
_OWN_FDS = 64  # what the keeper needs for itself, beyond the fds it stores
# Where orphans' statuses are kept, once `main` made the keeper their subreaper (Linux).
_orphans_dir: str | None = None
# How long a holder may take to be ready (escrowd --ready-deadline), set by `main`.
_ready_deadline = Config(socket_path="").ready_deadline


def main(config: Config, argv: list[str]) -> int:
    """Run the keeper on `config.socket_path` until it is stopped; `argv` (escrowd's own
    arguments) is passed on to every holder it starts."""
    socket_path = config.socket_path
    try:
        paths.check_socket_path(socket_path)
        paths.ensure_private_dir(os.path.dirname(socket_path))
        lock_fd = take_lock(socket_path)
    except (StartupError, paths.PathError) as exc:
        print(f"escrowd: {exc}", file=sys.stderr)
        return 1
    listener: socket.socket | None = None
    try:
        remove_leftover_socket(socket_path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(socket_path + ".notify")  # where an older keeper listened
        listener = bind_socket(socket_path)
        log("keeper", pid=os.getpid(), socket=socket_path)
        # The holder is told the socket's absolute path: it starts in `/`, not here.
        global _orphans_dir, _ready_deadline
        _ready_deadline = config.ready_deadline
        _orphans_dir = orphans.exits_dir(socket_path) if become_subreaper() else None
        return Keeper(listener, [*argv, "--socket", socket_path]).run()
    except StartupError as exc:
        print(f"escrowd: {exc}", file=sys.stderr)
        return 1
    finally:
        if listener is not None:
            listener.close()
        for leftover in (socket_path, paths.pid_path(socket_path)):
            with contextlib.suppress(OSError):
                os.unlink(leftover)
        os.close(lock_fd)


def store_capacity() -> int:
    """How many fds this keeper can store: its fd limit, less what it needs for itself."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return 1 << 30
    return max(0, soft - _OWN_FDS)


class Keeper:
    """Resource handling: owns the stored fds (`store`) and closes them all when it stops,
    and the channel to the running holder; the listener and the lock belong to `main`."""

    def __init__(self, listener: socket.socket, argv: list[str]) -> None:
        self.listener = listener
        self.argv = argv
        self.channel: socket.socket | None = None  # the keeper's end, to the running holder
        self.poller = select.poll()
        self.store: dict[str, list[int]] = {}
        self.holder: int | None = None
        self.holder_started = 0.0
        self.last_ping: float | None = None  # of the running holder, once it is ready
        self.ready_by: float | None = None  # the running holder is killed if not READY then
        self.restart_at = 0.0
        self.backoff = _BACKOFF_FIRST
        self.recent: list[float] = []  # when holders exited, within the last _STABLE seconds
        self.stopping = False
        self.upgrading = False
        self.stop_deadline: float | None = None
        self.trial = TrialRun()  # an upgrade's (escrowd.trial)
        self.standbys = Standbys(self.poller)  # the next holder, loaded (escrowd.standby)
        self.from_standby = False  # the running holder was a standby
        self.upgrade_at: float | None = None  # the old holder stops then, or once a standby

    # --- the loop ----------------------------------------------------------------------------

    def run(self) -> int:
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        os.set_blocking(wake_r, False)
        old_wakeup = signal.set_wakeup_fd(wake_w)
        handled = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD)
        old = {s: signal.signal(s, lambda *_: None) for s in handled}
        self.poller.register(wake_r, select.POLLIN)
        try:
            while not (self.stopping and self.holder is None):
                try:
                    self._turn(wake_r)
                except Exception as exc:
                    # Out of processes or fds, say: the stored fds are every session's
                    # life, so the keeper never exits on an error; it tries again later.
                    log("keeper_error", error=repr(exc), reason="trying again in a moment")
                    if self.holder is None:
                        self.restart_at = time.monotonic() + self.backoff
                        self.backoff = min(self.backoff * 2, _BACKOFF_MAX)
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)
            signal.set_wakeup_fd(old_wakeup)
            os.close(wake_r)
            os.close(wake_w)
            self._close_channel()
            self.standbys.drop()
            self._close_store()
        log("keeper_stopped", pid=os.getpid())
        return 0

    def _turn(self, wake_r: int) -> None:
        if self.holder is None and not self.stopping and time.monotonic() >= self.restart_at:
            self._start_holder()
        for fd, _ in self.poller.poll(self._timeout_ms()):
            if fd == wake_r:
                self._signals(os.read(wake_r, 512))
            elif fd == self.standbys.fileno():
                self.standbys.readable()
            else:
                self._messages()
        self._upgrade_tried()
        _reap(self)
        self._check_deadlines()
        self._keep_standby()

    def _timeout_ms(self) -> int:
        now = time.monotonic()
        due = [self.restart_at] if self.holder is None else []
        if self.trial.running:
            due.append(now + 0.05)  # an upgrade's trial run: look again soon
        if self.last_ping is not None:
            due.append(self.last_ping + WATCHDOG_SECONDS)
        due += [t for t in (self.ready_by, self.stop_deadline, self.upgrade_at) if t is not None]
        if self.last_ping is not None and self.standbys.current is None and not self.stopping:
            due.append(self.standbys.start_at)
        if not due:
            return -1
        return max(0, int((min(due) - now) * 1000) + 1)

    def _signals(self, received: bytes) -> None:
        for signum in received:
            if signum == signal.SIGINT and not self.stopping and _sessions(self.store):
                _not_interrupted(_sessions(self.store))
            elif signum in (signal.SIGTERM, signal.SIGINT) and not self.stopping:
                log("keeper_stopping", reason=signal.Signals(signum).name)
                self.stopping = True
                self.standbys.drop()
                self._stop_holder()
            elif signum == signal.SIGHUP and _terminal_hung_up():
                # The terminal this escrowd ran in was closed (its shell passes the hangup
                # on): nothing to upgrade; it serves on, its log in <socket>.log.
                log("keeper_terminal_gone", reason="serving on")
            elif signum == signal.SIGHUP and not (self.stopping or self.upgrading
                                                  or self.upgrade_at is not None):
                self.trial.start()

    # --- the holder --------------------------------------------------------------------------

    def _start_holder(self) -> None:
        names = [LISTENER_NAME]
        fds = [self.listener.fileno()]
        for name, stored in self.store.items():
            names += [name] * len(stored)
            fds += stored
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        if hard != resource.RLIM_INFINITY and 3 + len(fds) + 1 > hard:
            self._not_started(f"{len(fds) - 1} stored fds do not fit a holder's fd limit of "
                              f"{hard}: raise the hard limit (ulimit -Hn) of the keeper")
            return
        mine, theirs = channel_pair()
        fds.append(theirs.fileno())
        try:
            pid = self.standbys.hand_over(fds, names, store_capacity(), WATCHDOG_SECONDS)
            self.from_standby = pid is not None
            if pid is None:
                env = dict(_holder_env(), FDSTORE=str(store_capacity()))
                pid = fork_holder(python_command("escrowd", "--bare", *self.argv), env,
                                  fds, names, WATCHDOG_SECONDS, mine)
        except OSError as exc:
            mine.close()
            self._not_started(f"cannot fork: {exc.strerror}")
            return
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        self.channel = mine
        self.poller.register(mine, select.POLLIN)
        self.holder, self.holder_started, self.last_ping = pid, time.monotonic(), None
        self.ready_by = self.holder_started + _ready_deadline
        log("keeper_started_holder", holder_pid=pid, stored_fds=len(fds) - 2,
            via="standby" if self.from_standby else "exec")

    def _keep_standby(self) -> None:
        """A standby once the holder serves (not before: it would slow the holder's start);
        and the old holder of an upgrade stopped once a standby of the new code is loaded."""
        if self.holder is not None and self.last_ping is not None and not self.stopping:
            self.standbys.keep(python_command("escrowd", "--bare", *self.argv),
                               _holder_env())
        if self.upgrade_at is not None and (self.standbys.ready
                                            or time.monotonic() >= self.upgrade_at):
            # (upgrading only with a holder to stop: else every later SIGHUP is ignored)
            self.upgrade_at, self.upgrading = None, self.holder is not None
            self._stop_holder()

    def _not_started(self, reason: str) -> None:
        log("keeper_cannot_start_holder", reason=reason, retry_in=round(self.backoff, 3))
        self.restart_at = time.monotonic() + self.backoff
        self.backoff = min(self.backoff * 2, _BACKOFF_MAX)

    def _close_channel(self) -> None:
        if self.channel is not None:
            self.poller.unregister(self.channel)
            self.channel.close()
            self.channel = None

    def _stop_holder(self) -> None:
        if self.holder is not None and self.stop_deadline is None:  # signalled once only
            log("keeper_stopping_holder", holder_pid=self.holder,
                reason="upgrade" if self.upgrading else "stopping")
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.holder, signal.SIGTERM)
            self.stop_deadline = time.monotonic() + STOP_GRACE

    def _upgrade_tried(self) -> None:
        if self.trial.passed() is not True:
            return
        self.standbys.drop(renew=True)  # it runs the code that was installed before
        if self.holder is None:
            self.restart_at = 0.0
            return
        # The old holder stops once a standby of the new code (_keep_standby) is loaded.
        self.upgrade_at = time.monotonic() + STOP_GRACE / 2

    def _reap(self) -> None:
        self.standbys.reap()
        if self.holder is None:
            return
        try:
            pid, status = os.waitpid(self.holder, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        self._messages()  # everything it sent before it exited still counts
        self._close_channel()
        self._holder_exited(os.waitstatus_to_exitcode(status))

    def _holder_exited(self, code: int) -> None:
        lived = time.monotonic() - self.holder_started
        was_ready = self.last_ping is not None
        self.holder, self.last_ping, self.stop_deadline, self.ready_by = None, None, None, None
        # An upgrade's stop was for this holder: the next one runs the installed code.
        upgrading, self.upgrading, self.upgrade_at = self.upgrading, False, None
        log("keeper_holder_exited", code=code, lived=round(lived, 3), stored=len(self.store))
        if self.stopping:
            return
        if self.from_standby and not was_ready:
            # A takeover that did not come to READY: a holder by exec now, and standbys
            # again once one has served.
            self.standbys.exec_next = True
            self.restart_at = time.monotonic()
            return
        if upgrading:
            self.restart_at, self.backoff = 0.0, _BACKOFF_FIRST
            return
        if code == 0 and not self.store:
            self.stopping = True  # stopped by itself (--idle-exit) with nothing kept
            return
        # A holder that died once it served is replaced at once: its sessions wait. Back-off
        # is for a crash loop: dying before it was ready, or restarts piling up.
        now = time.monotonic()
        self.recent = [t for t in self.recent if now - t < _STABLE] + [now]
        if was_ready and len(self.recent) <= _RESTARTS_AT_ONCE:
            self.backoff = _BACKOFF_FIRST
            self.restart_at = now
            return
        if lived >= _STABLE:
            self.backoff = _BACKOFF_FIRST
        self.restart_at = now + self.backoff
        self.backoff = min(self.backoff * 2, _BACKOFF_MAX)

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        if self.holder is None:
            return
        if self.stop_deadline is not None and now >= self.stop_deadline:
            _kill(self.holder, "did not stop in time")
            self.stop_deadline = None
        elif self.last_ping is not None and now >= self.last_ping + WATCHDOG_SECONDS:
            _kill(self.holder, "watchdog: no ping")
            self.last_ping = None
        elif self.ready_by is not None and now >= self.ready_by:
            _kill(self.holder, f"not ready {_ready_deadline:g} s after its start (frozen?)")
            self.ready_by = None

    # --- the holder's notifications (escrowd.notify) -----------------------------------------

    def _messages(self) -> None:
        if self.channel is not None:
            read_notifications(self.channel, self.store, self.holder, self._pinged)

    def _close_store(self) -> None:
        for fds in self.store.values():
            close_fds(fds)
        self.store.clear()

    def _pinged(self) -> None:
        self.last_ping, self.ready_by = time.monotonic(), None
        if not self.from_standby:
            self.standbys.exec_next = False


def _reap(keeper: Keeper) -> None:
    """Reap the keeper's own children that ended (Keeper._reap), then, once `main` made it
    their subreaper, the ended orphans, their statuses kept first (escrowd.orphans)."""
    keeper._reap()
    if _orphans_dir is None:
        return
    own = {keeper.holder, *keeper.standbys.dying}
    if keeper.standbys.current is not None:
        own.add(keeper.standbys.current.pid)
    if keeper.trial.proc is not None:
        own.add(keeper.trial.proc.pid)
    orphans.reap({pid for pid in own if pid is not None}, _orphans_dir)


def _kill(holder: int, reason: str) -> None:
    log("keeper_kill", holder_pid=holder, reason=reason)
    with contextlib.suppress(ProcessLookupError):
        os.kill(holder, signal.SIGKILL)


def _not_interrupted(sessions: int) -> None:
    log("keeper_interrupt", sessions=sessions, reason=(
        f"not stopping: {sessions} session(s) are escrowed, and their terminals would hang "
        f"up. To stop anyway: escrowctl stop --force, or kill -TERM {os.getpid()}. To leave "
        "them escrowed, close this terminal: escrowd serves on, and logs to its socket's "
        ".log file"))


def _sessions(store: dict[str, list[int]]) -> int:
    return sum(1 for name in store if name.startswith(SESSION_PREFIX))


def _holder_env() -> dict[str, str]:
    """A holder's environment (or a standby's), before what is passed with its fds."""
    return dict(os.environ, **{KEEPER_ENV: str(os.getpid())})


def _terminal_hung_up() -> bool:
    """True if a terminal the keeper writes to (stdin, stdout, stderr) has hung up: then a
    SIGHUP says that terminal closed, not `escrowctl upgrade`."""
    for fd in (0, 1, 2):
        try:
            if not stat.S_ISCHR(os.fstat(fd).st_mode):
                continue
        except OSError:
            continue
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        if any(events & select.POLLHUP for _, events in poller.poll(0)):
            return True
    return False
