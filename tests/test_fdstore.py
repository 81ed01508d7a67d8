"""The fd store as the holder speaks to it, with the test as the service manager
(docs/design.md §11).

The test owns `$NOTIFY_SOCKET`, as systemd would: it receives every `FDSTORE=1` message
with its fds, and starts the next holder with them in `LISTEN_FDS`/`LISTEN_FDNAMES`. So it
can check what goes into the store, hand a holder a store it has spoilt on purpose, stop
reading it (a manager whose queue is full, as a busy one's is: a Unix datagram queue holds
as few as 10), or go away.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hostile import read_more_lines

from conftest import OWNER, HolderProcess, PtyChild, wait_for
from escrow_client import EscrowClient, EscrowError, fdpass
from escrowd.fdstore import STORE_DEADLINE
from escrowd.takeup import LOST_LABEL

TICKER = ["sh", "-c", "i=0; while :; do i=$((i+1)); echo L$i; sleep 0.02; done"]

# Places the given fds at 3, 4, ... and execs escrowd --bare with LISTEN_* naming them.
LAUNCH = textwrap.dedent("""
    import fcntl, os, sys
    fds = [int(fd) for fd in sys.argv[1].split(",")] if sys.argv[1] else []
    names = sys.argv[2]
    # Out of the way first (above every target), so that no dup2 overwrites one still needed.
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3 + len(fds)) for fd in fds]
    for n, fd in enumerate(high):
        os.dup2(fd, 3 + n)
    env = dict(os.environ, LISTEN_FDS=str(len(fds)), LISTEN_PID=str(os.getpid()),
               LISTEN_FDNAMES=names)
    os.execve(sys.executable, [sys.executable, "-m", "escrowd", "--bare", *sys.argv[3:]], env)
""")


class Store:
    """The test's fd store: a datagram socket bound where $NOTIFY_SOCKET points.
    Resource handling: every fd it received is closed by `close()`."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.fds: dict[str, list[int]] = {}
        self.removed: list[str] = []
        self.fillers: list[socket.socket] = []

    def take(self, timeout: float = 0.0) -> None:
        """Everything sent so far (waiting up to `timeout` for the first datagram)."""
        select.select([self.sock], [], [], timeout)
        self.sock.setblocking(False)
        while True:
            try:
                data, anc, flags, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(16 * 4))
            except BlockingIOError:
                return
            fields = dict(line.split("=", 1) for line in data.decode().splitlines()
                          if "=" in line)
            fds = fdpass.fds_from_ancillary(anc, flags)
            if fields.get("FDSTORE") == "1":
                self.fds.setdefault(fields["FDNAME"], []).extend(fds)
                assert fields.get("FDPOLL") == "0", fields  # a hung-up master must stay
            else:
                fdpass.close_fds(fds)
            if fields.get("FDSTOREREMOVE") == "1":
                self.removed.append(fields["FDNAME"])
                fdpass.close_fds(self.fds.pop(fields["FDNAME"], []))

    def fill(self) -> None:
        """Fill the queue with datagrams of no meaning (read and ignored by `take`), until
        nothing more can be sent to it. A socket's own send buffer can run out first: the
        queue is full once a fresh socket cannot send even one."""
        while True:
            filler = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self.fillers.append(filler)
            filler.setblocking(False)
            filler.connect(self.path)
            sent = 0
            try:
                while True:
                    filler.send(b"FILLER=1")
                    sent += 1
            except BlockingIOError:
                if sent == 0:
                    return

    def close(self) -> None:
        for fds in self.fds.values():
            fdpass.close_fds(fds)
        for filler in self.fillers:
            filler.close()
        self.sock.close()


@pytest.fixture
def store(socket_dir: Path) -> Iterator[Store]:
    s = Store(str(socket_dir / "notify"))
    yield s
    s.close()


def start(directory: Path, store: Store, passed: list[tuple[str, int]]) -> HolderProcess:
    """A bare holder on `directory/escrowd.sock`, told of `store`, passed `passed`."""
    directory.mkdir(mode=0o700, exist_ok=True)
    sock = str(directory / "escrowd.sock")
    log_path = directory / f"escrowd-{len(os.listdir(directory))}.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LISTEN_", "WATCHDOG_"))}
    env["NOTIFY_SOCKET"] = store.path
    fds = [fd for _, fd in passed]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", LAUNCH, ",".join(map(str, fds)),
             ":".join(name for name, _ in passed), "--socket", sock],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, pass_fds=fds, env=env)
    holder = HolderProcess(sock, proc, log_path)

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"escrowd exited with {proc.returncode}: {holder.logs()}")
        return " event=ready " in holder.logs()

    wait_for(ready, 15.0, "escrowd to be ready")
    return holder


def test_a_deposit_is_answered_only_once_its_fds_are_stored(
    socket_dir: Path, store: Store, pty_children: Callable[..., PtyChild],
) -> None:
    """`deposited` comes after the store message: by then the master and the state file
    are both in the store under one name, with FDPOLL=0. A session that ends (released)
    leaves the store at once (FDSTOREREMOVE)."""
    holder = start(socket_dir / "a", store, [])
    try:
        kid = pty_children(TICKER)
        with holder.client().custody() as custody:
            custody.deposit("tab", kid.master, child_pid=kid.pid)
            store.take()  # no waiting: it is there already
            names = [n for n in store.fds if n.startswith("session-")]
            assert len(names) == 1, store.fds
            kinds = sorted(os.readlink(f"/proc/self/fd/{fd}").split(":")[0]
                           for fd in store.fds[names[0]])
            assert kinds == ["/dev/ptmx", "/memfd"], kinds
            custody.release("tab")
        store.take(timeout=5.0)
        assert store.removed == names and names[0] not in store.fds
    finally:
        holder.stop()


def test_a_spoilt_store_closes_no_terminal(
    socket_dir: Path, store: Store, pty_children: Callable[..., PtyChild],
) -> None:
    """A store spoilt four ways: a state file whose header fails its checksum, a master
    without its state file, a state file without its master, and a name that is not ours
    (on /dev/null). Incident pinned: the first two masters were closed (their shells got
    SIGHUP) and nothing said the sessions had existed. Now doubt never closes a terminal:
    both are adopted with a fresh ring, listed under a name that says their record is lost
    and their replay marked lost from its start, and they drain on (their shells live);
    what is not a terminal is closed, logged (`adopt_refused`) and taken out of the store.
    The good session is adopted as it was, and retrieved whole."""
    first = start(socket_dir / "a", store, [])
    kids = [pty_children(TICKER) for _ in range(4)]
    client = first.client()
    for n, kid in enumerate(kids):
        client.hand_off(f"tab-{n}", kid.master, child_pid=kid.pid)
        os.close(kid.master)  # the store's copies (and the holder's) are the only ones
        kid.master = -1
    store.take(timeout=5.0)
    names = sorted(n for n in store.fds if n.startswith("session-"))
    assert len(names) == 4
    os.kill(first.pid, signal.SIGKILL)
    first.proc.wait()

    def parts(name: str) -> tuple[int, int]:
        master, state = sorted(store.fds[name], key=lambda fd: "memfd" in os.readlink(
            f"/proc/self/fd/{fd}"))
        return master, state

    good, spoilt, no_state, no_master = names
    os.pwrite(parts(spoilt)[1], b"\xff", 20)  # inside the checksummed header
    passed = [(good, fd) for fd in store.fds[good]]
    passed += [(spoilt, fd) for fd in store.fds[spoilt]]
    passed += [(no_state, parts(no_state)[0])]
    passed += [("session-orphan", parts(no_master)[1])]
    passed += [("holder", fd) for fd in store.fds.get("holder", [])]
    junk = os.open(os.devnull, os.O_RDONLY)
    passed += [("session-junk", junk)]
    second = start(socket_dir / "b", store, passed)
    os.close(junk)
    # The store lets go of what it passed; the holder keeps (and stores) what it adopts.
    for name in (spoilt, no_state, no_master):
        fdpass.close_fds(store.fds.pop(name))
    try:
        refused = {line.split(" name=")[1].split()[0]: line
                   for line in second.log_lines("adopt_refused")}
        assert set(refused) == {"session-orphan", "session-junk"}, refused
        status = second.client("escrowctl").status()
        assert (status.adopted, status.adopted_without_record) == (3, 2)
        assert status.unclean_restarts == 1
        listed = second.client("escrowctl").list(all_owners=True)
        lost = [s for s in listed if s.label == LOST_LABEL]
        assert all(s.state == "draining" and s.replay_gaps[:1] == [0] for s in lost), lost
        # The spoilt file's records are whole, past its header: the session keeps its name.
        # The master stored alone has no name to keep: its name says its record is lost.
        assert sorted(s.owner for s in lost) == ["com.example.term", "escrowd"], listed
        assert [s.id[:8] for s in lost if s.owner == "escrowd"] == ["lost-pts"], listed
        assert len([s for s in listed if s.owner == OWNER]) == 2, listed
        store.take(timeout=5.0)
        assert {spoilt, no_state, "session-orphan", "session-junk"} <= set(store.removed)
        # The shell whose master the store lost hangs up; the three others live on.
        wait_for(lambda: [kid.proc.poll() for kid in kids].count(None) == 3, 10.0,
                 "one shell, and one only, to hang up")
        got = EscrowClient(OWNER, socket_path=second.socket).reclaim_all()
        assert len(got.retrieved) == 2 and got.failed == {}
        for r in got.retrieved.values():
            os.close(r.fd)
        for info in lost:
            if info.owner == "escrowd":
                second.client("escrowd").release(info.id)
    finally:
        second.stop()


@pytest.mark.parametrize("spoilt", ["gone", "full"])
def test_a_deposit_whose_fds_the_store_does_not_take_is_refused(
    socket_dir: Path, store: Store, pty_children: Callable[..., PtyChild], spoilt: str,
) -> None:
    """A store that went away (`gone`: the send is refused at once), or one whose queue
    stays full past STORE_DEADLINE (`full`): the deposit is answered an error, never
    `deposited`, since its fds are not safe outside the holder: the app keeps its terminal,
    knowing it is not protected. Nothing of it stays: `list` shows nothing, and the holder
    has no fd more than before."""
    holder = start(socket_dir / "a", store, [])
    try:
        store.take(timeout=5.0)
        holder.baseline_fds = holder.fd_count()
        if spoilt == "gone":
            store.sock.close()
        else:
            store.fill()
        kid = pty_children(TICKER)
        client = holder.client(timeout=STORE_DEADLINE + 5.0)
        try:
            client.hand_off("tab", kid.master, child_pid=kid.pid)
        except EscrowError as exc:
            assert exc.code == "limit", exc
        else:
            pytest.fail(f"a deposit whose fds the store did not take ({spoilt}) was "
                        "answered deposited")
        assert client.list() == [], "a refused deposit is listed"
        holder.wait_fds_at_baseline()
        read_more_lines(kid.master, b"", 1)  # the app's terminal is still the app's
        if spoilt == "full":
            store.take()
            assert not [n for n in store.fds if n.startswith("session-")], store.fds
    finally:
        holder.stop()


def test_a_removal_that_finds_the_store_full_is_sent_once_it_has_room(
    socket_dir: Path, store: Store, pty_children: Callable[..., PtyChild],
) -> None:
    """A session released while the store's queue is full: the release is answered at
    once, and the store is told to drop the session's fds (FDSTOREREMOVE) as soon as its
    queue has room again. Were the removal dropped, the store would keep the terminal's
    master for as long as it runs, and the released shell would never get its hangup."""
    holder = start(socket_dir / "a", store, [])
    try:
        kid = pty_children(TICKER)
        client = holder.client()
        client.hand_off("tab", kid.master, child_pid=kid.pid)
        os.close(kid.master)
        kid.master = -1
        store.take()
        (name,) = [n for n in store.fds if n.startswith("session-")]
        store.fill()
        client.release("tab")
        assert kid.proc.poll() is None  # the store still has the terminal

        def removed() -> bool:
            store.take()  # makes room: the holder sends what waited
            return name in store.removed

        wait_for(removed, 10.0, "the removal to come once the store's queue had room")
        assert name not in store.fds
        # The last copy of the master is gone: the shell got its hangup.
        assert kid.proc.wait(10) == -signal.SIGHUP
    finally:
        holder.stop()


def test_a_session_cap_the_store_cannot_hold_is_refused_or_lowered(
    make_holder: Callable[..., HolderProcess], store: Store, socket_dir: Path,
) -> None:
    """Incident pinned: the unit fixed FileDescriptorStoreMax=4224, so a holder with a
    higher --max-sessions answered `deposited` for sessions systemd then dropped, saying so
    only in its journal. With $FDSTORE (systemd 254, and the keeper) the holder knows the
    store's room: a cap given that does not fit is refused at start, saying how to fix it;
    the default is lowered to fit."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LISTEN_", "WATCHDOG_"))}
    env.update(NOTIFY_SOCKET=store.path, FDSTORE="31")
    refused = subprocess.run(
        [sys.executable, "-m", "escrowd", "--bare", "--socket",
         str(socket_dir / "refused.sock"), "--max-sessions", "11"],
        env=env, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert refused.returncode == 1, refused.stderr
    assert "the fd store holds 31 fds, and --max-sessions 11 needs 34" in refused.stderr
    holder = make_holder(env=env)
    assert holder.client().status().limits["max_sessions"] == 10
    assert holder.log_lines("limit"), holder.logs()


def test_a_deposit_not_yet_stored_is_not_listed(
    socket_dir: Path, store: Store, pty_children: Callable[..., PtyChild],
) -> None:
    """Found in review: while a deposit waited for the store, `list` showed it held by the
    app: an app settling a deposit it got no answer to (DepositIndeterminate) took that for
    proof it had arrived, and said it was protected, though the store then refused it and
    the holder let it go. Nothing is listed before its fds are safe."""
    holder = start(socket_dir / "a", store, [])
    try:
        store.take(timeout=5.0)
        store.fill()
        kid = pty_children(TICKER)
        refused: list[BaseException] = []

        def deposit() -> None:
            try:
                holder.client(timeout=STORE_DEADLINE + 5.0).hand_off("tab", kid.master,
                                                                     child_pid=kid.pid)
            except EscrowError as exc:
                refused.append(exc)

        depositing = threading.Thread(target=deposit)
        depositing.start()
        wait_for(lambda: holder.log_lines("state"), 5.0, "the deposit to reach the holder")
        assert holder.client().list() == [], "listed before its fds were stored"
        depositing.join(STORE_DEADLINE + 10)
        assert len(refused) == 1 and holder.client().list() == []
    finally:
        holder.stop()
