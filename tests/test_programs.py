"""Programs the holder starts (`start`), their exit status, `escrowctl wait` and `list --all`
(escrowd.programs, escrowd.orphans, docs/design.md §15).

On a real screen: `escrowctl run` detached with Ctrl-\\, its program ending while nobody
is attached, and `escrowctl wait` exiting with its status. Without one: the library's
`start` against a real holder (refusals that leave nothing behind, a handoff never acked),
a real keeper whose holder is SIGKILLed while the program runs, and the statuses the keeper
keeps, which a holder believes only when they are the user's own and name the very process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import msgspec
import psutil
import pytest
from hypothesis import given
from hypothesis import strategies as st
from rawclient import RawClient
from test_attach import RUN_OWNER, Screens, detach, escrowctl_in_a_pty
from test_attach import screens as screens  # (the fixture)

from conftest import OWNER, HolderProcess, PtyChild, wait_for
from escrow_client import errors, paths, protocol
from escrow_client.liveness import process_start_time
from escrow_client.program_wait import wait
from escrow_client.run_start import start
from escrowd import orphans
from escrowd.programs import Programs
from escrowd.registry import Registry
from escrowd.session import Session
from escrowd.statefile import Record, StateFile

ESCROWCTL = [sys.executable, "-m", "escrow_client.cli"]


def escrowctl(holder: HolderProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*ESCROWCTL, "--socket", holder.socket, *args], capture_output=True,
                          text=True, timeout=30, stdin=subprocess.DEVNULL)


def until_file(path: Path, code: str) -> list[str]:
    """A program that runs until `path` exists, then ends as `code` says."""
    return ["sh", "-c", f"while [ ! -e {path} ]; do sleep 0.02; done; {code}"]


def started(holder: HolderProcess, sid: str, argv: list[str],
            owner: str = OWNER) -> protocol.SessionInfo:
    """Start `argv` through the holder as `sid` and let go of custody: it drains."""
    with holder.client(owner).custody() as custody:
        got = start(custody, sid, argv, cols=80, rows=24)
        os.close(got.fd)
    return got.session


def info(holder: HolderProcess, sid: str, owner: str = OWNER) -> protocol.SessionInfo:
    return next(s for s in holder.client(owner).list() if s.id == sid)


# --- on a real screen -----------------------------------------------------------------


def test_run_detached_then_wait_exits_with_the_programs_status(
    screens: Screens, holder: HolderProcess
) -> None:
    go = screens.dir / "go"
    a = screens.pane("a")
    a.line(f"escrowctl run --id w1 -- sh -c 'echo run\"\"ning; while [ ! -e {go} ]; do "
           "sleep 0.02; done; exit 3'")
    a.wait_text("running")  # (not the command line's: escrowctl has the terminal now)
    detach(a, "w1", holder)
    assert info(holder, "w1", RUN_OWNER).started
    assert info(holder, "w1", RUN_OWNER).exit_status is None  # it runs
    go.touch()
    a.line(f"escrowctl wait {RUN_OWNER}/w1; echo rc=$?")
    assert int(a.wait_line(r"^rc=(\d+)$")[1]) == 3
    listed = escrowctl(holder, "list", "--all")
    row = next(line for line in listed.stdout.splitlines() if f"{RUN_OWNER}/w1 " in line)
    header = listed.stdout.splitlines()[0]
    assert row[header.index("EXIT"):].split()[0] == "3"
    assert f"{RUN_OWNER}/w1 " in escrowctl(holder, "list").stdout  # exited: still live
    holder.client(RUN_OWNER).release("w1")
    assert f"{RUN_OWNER}/w1 " not in escrowctl(holder, "list").stdout  # a tombstone: --all
    [js] = [s for s in msgspec.json.decode(escrowctl(holder, "list", "--all", "--json").stdout)
            if s["id"] == "w1"]
    assert (js["started"], js["exit_status"]) == (True, {"code": 3})


# --- the library and escrowctl wait against a real holder --------------------------------


def test_a_signal_death_waits_as_128_plus_n(holder: HolderProcess) -> None:
    started(holder, "sig", ["sh", "-c", "kill -KILL $$"])
    assert wait(holder.client(), "sig", 10) == protocol.ExitStatus(signal=9)
    assert escrowctl(holder, "wait", f"{OWNER}/sig").returncode == 128 + 9
    assert info(holder, "sig").exit_status == protocol.ExitStatus(signal=9)


def test_wait_says_why_there_is_no_status(holder: HolderProcess,
                                          pty_children: Callable[..., PtyChild]) -> None:
    assert escrowctl(holder, "wait", f"{OWNER}/nothing").returncode == 122
    app = pty_children(["sh", "-c", "exec sleep 60"])
    holder.client().hand_off("by-an-app", app.master, child_pid=app.pid)
    result = escrowctl(holder, "wait", f"{OWNER}/by-an-app")
    assert result.returncode == 123, result.stderr
    assert "did not start" in result.stderr
    runs = started(holder, "runs", ["sh", "-c", "exec sleep 60"])
    assert escrowctl(holder, "wait", "--deadline", "0.3", f"{OWNER}/runs").returncode == 124
    assert info(holder, "by-an-app").exit_status is None  # not the holder's to know
    os.kill(runs.child_pid or 0, signal.SIGTERM)
    assert escrowctl(holder, "wait", f"{OWNER}/runs").returncode == 128 + 15


def test_a_program_that_ends_after_its_session_was_released_has_its_status_kept(
    holder: HolderProcess,
) -> None:
    """Released, its terminal closed: the program's SIGHUP is kept in the tombstone."""
    started(holder, "let-go", ["sh", "-c", "while :; do sleep 0.05; done"])
    holder.client().release("let-go")
    assert wait(holder.client(), "let-go", 10) == protocol.ExitStatus(signal=signal.SIGHUP)
    tomb = next(s for s in holder.client().list() if s.id == "let-go")
    assert (tomb.state, tomb.exit_status) == ("released", protocol.ExitStatus(signal=1))


def test_attach_of_an_ended_program_says_how_it_ended(
    holder: HolderProcess, pty_children: Callable[..., PtyChild], tmp_path: Path
) -> None:
    started(holder, "gone", until_file(tmp_path / "go", "echo last words; exit 7"))
    (tmp_path / "go").touch()  # (its words come once the holder drains it)
    wait_for(lambda: info(holder, "gone").state == "exited", 10, "the session to exit")
    rc, out = escrowctl_in_a_pty(pty_children, holder, "attach", f"{OWNER}/gone")
    assert rc == 0, out
    assert "last words" in out
    assert "its program exited with status 7" in out, out
    assert escrowctl(holder, "wait", f"{OWNER}/gone").returncode == 7  # its tombstone's


def test_start_refusals_leave_nothing_behind(holder: HolderProcess, tmp_path: Path) -> None:
    go = tmp_path / "go"
    started(holder, "other", until_file(go, "exit 5"))
    client = holder.client()
    fds = holder.fd_count()
    refusals = {
        "exec_failed": (["/no/such/program"], {}),
        "cwd_gone": (["true"], {"cwd": str(tmp_path / "gone")}),
        "bad_request": (["sh", "-c", "true\0"], {}),
        "exists": (["true"], {"sid": "other"}),
    }
    for code, (argv, how) in refusals.items():
        with client.custody() as custody, pytest.raises(errors.EscrowError) as raised:
            start(custody, str(how.get("sid", f"r-{code}")), argv, cwd=how.get("cwd"))
        assert raised.value.code == code, raised.value
    nul = {"cwd": (str(tmp_path) + "\0x", None), "env": ("/", {"A": "b\0c"}),
           "name": ("/", {"A=B": "c"})}
    for why, (cwd, env) in nul.items():  # each once leaked an fd and dropped the connection
        with client.custody() as custody, pytest.raises(errors.BadRequest):
            start(custody, f"nul-{why}", ["true"], cwd=cwd, env=env)
    with client.custody() as custody, pytest.raises(errors.BadRequest):
        start(custody, "huge", ["x"] * (protocol.MAX_ARGS + 1))
    assert {s.id for s in client.list()} == {"other"}
    # (At most: the count before may include a connection the holder had yet to close.)
    wait_for(lambda: holder.fd_count() <= fds, 5, f"the holder's fds back to {fds}")
    go.touch()
    assert wait(client, "other", 10) == protocol.ExitStatus(code=5)


def test_a_start_never_acked_leaves_the_session_draining(holder: HolderProcess,
                                                         tmp_path: Path) -> None:
    """A client that takes the handoff and hangs up without its ack: the program runs on,
    drained; nothing is lost."""
    go = tmp_path / "go"
    with RawClient(holder.socket) as raw:
        raw.hello()
        raw.send(protocol.Start(id="unacked", argv=until_file(go, "echo last words; exit 4")))
        reply, fd = raw.receive()
        assert isinstance(reply, protocol.Handoff) and fd is not None
    wait_for(lambda: info(holder, "unacked").state == "draining", 10, "drained again")
    assert info(holder, "unacked").child_alive
    go.touch()
    assert wait(holder.client(), "unacked", 10) == protocol.ExitStatus(code=4)
    got = holder.client().retrieve("unacked")
    os.close(got.fd)
    assert b"last words" in bytes(got.replay)


# --- the holder SIGKILLed while its program runs -------------------------------------------


@pytest.mark.skipif(sys.platform != "linux", reason="macOS has no subreaper: `unknown` there")
def test_a_status_outlives_a_holder_sigkilled_under_the_keeper(
    make_holder: Callable[..., HolderProcess], tmp_path: Path
) -> None:
    keeper = make_holder(keeper=True)
    before, after = tmp_path / "before", tmp_path / "after"
    started(keeper, "done", ["sh", "-c", "exit 8"])  # reaped by the first holder: recorded
    assert wait(keeper.client(), "done", 10) == protocol.ExitStatus(code=8)
    early = started(keeper, "early", until_file(before, "exit 6"))  # ends with no holder
    late = started(keeper, "late", until_file(after, "exit 3"))  # ends under the next one
    first = keeper.serving_pid()
    os.kill(first, signal.SIGSTOP)  # (its child "early" ends, and stays a zombie)
    before.touch()
    wait_for(lambda: psutil.Process(early.child_pid or 0).status() == psutil.STATUS_ZOMBIE,
             10, "early to end while its holder cannot reap it")
    os.kill(first, signal.SIGKILL)
    wait_for(lambda: _serving_other_than(keeper, first), 20, "the keeper's next holder")
    assert psutil.Process(late.child_pid or 0).ppid() == keeper.pid  # the subreaper's
    after.touch()
    assert escrowctl(keeper, "wait", f"{OWNER}/late").returncode == 3
    assert escrowctl(keeper, "wait", f"{OWNER}/early").returncode == 6
    assert info(keeper, "late").exit_status == protocol.ExitStatus(code=3)
    assert escrowctl(keeper, "wait", f"{OWNER}/done").returncode == 8  # from its state file


@pytest.mark.skipif(sys.platform != "linux", reason="macOS has no subreaper: `unknown` there")
def test_a_status_nobody_could_keep_is_unknown(
    make_holder: Callable[..., HolderProcess], tmp_path: Path
) -> None:
    """The holder dies with its program's status unreaped, and the keeper cannot keep it
    (something not a private directory is where it keeps them): the next holder says
    `unknown`, never a code."""
    keeper = make_holder(keeper=True)
    Path(orphans.exits_dir(keeper.socket)).write_text("not a directory\n")
    go = tmp_path / "go"
    lost = started(keeper, "lost", until_file(go, "exit 4"))
    first = keeper.serving_pid()
    os.kill(first, signal.SIGSTOP)
    go.touch()
    wait_for(lambda: psutil.Process(lost.child_pid or 0).status() == psutil.STATUS_ZOMBIE,
             10, "the program to end while its holder cannot reap it")
    os.kill(first, signal.SIGKILL)
    wait_for(lambda: _serving_other_than(keeper, first), 20, "the keeper's next holder")
    result = escrowctl(keeper, "wait", f"{OWNER}/lost")
    assert result.returncode == 125, result.stderr
    assert info(keeper, "lost").exit_status == "unknown"
    listed = escrowctl(keeper, "list", "--all").stdout.splitlines()
    row = next(line for line in listed if f"{OWNER}/lost " in line)
    assert row[listed[0].index("EXIT"):].split()[0] == "?"
    assert keeper.log_lines("keeper_orphan_reaped"), "the keeper reaped it all the same"


@pytest.mark.skipif(sys.platform != "linux", reason="macOS has no subreaper: `unknown` there")
def test_run_whose_program_status_nobody_could_keep_exits_125(
    make_holder: Callable[..., HolderProcess], pty_children: Callable[..., PtyChild],
    tmp_path: Path,
) -> None:
    """`escrowctl run` attached while its holder dies and the keeper cannot keep the
    program's status: "unknown" is 125 as for `escrowctl wait`, never 0."""
    keeper = make_holder(keeper=True)
    Path(orphans.exits_dir(keeper.socket)).write_text("not a directory\n")
    go = tmp_path / "go"
    run = pty_children([*ESCROWCTL, "--socket", keeper.socket, "run", "--id", "lost-run",
                        "--", *until_file(go, "exit 4")])
    wait_for(lambda: any(s.id == "lost-run" and s.state == "held"
                         for s in keeper.client(RUN_OWNER).list()), 10, "run to attach")
    first = keeper.serving_pid()
    os.kill(first, signal.SIGKILL)
    wait_for(lambda: _serving_other_than(keeper, first), 20, "the keeper's next holder")
    go.touch()
    out = b""
    while chunk := run.read_available(timeout=10):
        out += chunk
    assert run.proc.wait(10) == 125, out
    assert b"how is unknown" in out, out


@pytest.mark.skipif(sys.platform != "linux", reason="macOS has no subreaper: `unknown` there")
def test_wait_outlives_a_restart_whose_next_holder_answers_late(
    make_holder: Callable[..., HolderProcess], tmp_path: Path
) -> None:
    """The holder dies under a wait and nothing answers for longer than the client's
    timeout (the keeper is stopped): the wait asks again, and exits with the status."""
    keeper = make_holder(keeper=True)
    go = tmp_path / "go"
    started(keeper, "late-answer", until_file(go, "exit 7"))
    first = keeper.serving_pid()
    seen = [keeper.client().status().counters["connections"]]
    said = tmp_path / "said"
    with said.open("wb") as stderr:
        waiting = subprocess.Popen([*ESCROWCTL, "--socket", keeper.socket, "--timeout",
                                    "0.5", "wait", f"{OWNER}/late-answer"],
                                   stdin=subprocess.DEVNULL, stderr=stderr)
    try:
        def taken() -> bool:
            """Accepted by the holder, not only queued where the keeper listens too: each
            look is a connection of its own, the wait one more."""
            seen.append(keeper.client().status().counters["connections"])
            return seen[-1] - seen[0] >= len(seen)

        wait_for(taken, 10, "the holder to take the wait")
        os.kill(keeper.pid, signal.SIGSTOP)
        try:
            os.kill(first, signal.SIGKILL)
            with pytest.raises(subprocess.TimeoutExpired):  # past two of its timeouts
                rc = waiting.wait(1.5)
                pytest.fail(f"wait exited {rc}: {said.read_text()}")
        finally:
            os.kill(keeper.pid, signal.SIGCONT)
        wait_for(lambda: _serving_other_than(keeper, first), 20, "the keeper's next holder")
        go.touch()
        assert waiting.wait(20) == 7, said.read_text()
    finally:
        if waiting.poll() is None:
            waiting.kill()
            waiting.wait()


@pytest.mark.skipif(sys.platform != "linux", reason="macOS has no subreaper")
def test_the_keeper_keeps_only_session_programs_statuses(
    make_holder: Callable[..., HolderProcess],
) -> None:
    """Orphans that were no session's program (here a program's own children) are reaped
    and nothing is kept for them: a burst of them cannot push a program's status out. A
    program's mark goes once its end is known."""
    keeper = make_holder(keeper=True)
    exits = Path(orphans.exits_dir(keeper.socket))
    started(keeper, "burst", ["sh", "-c", "for i in 1 2 3 4 5 6; do (sleep 0.1 &); done"])
    assert wait(keeper.client(), "burst", 10) == protocol.ExitStatus(code=0)
    wait_for(lambda: len(keeper.log_lines("keeper_orphan_reaped")) >= 6, 10,
             "the keeper to reap the program's children")
    wait_for(lambda: not exits.exists() or os.listdir(exits) == [], 5,
             "nothing kept, no mark left")


def _serving_other_than(holder: HolderProcess, pid: int) -> bool:
    record = paths.read_pidfile(holder.socket)
    if record is None or record.pid == pid:
        return False
    try:
        holder.client().status()
    except errors.EscrowError:
        return False
    return True


# --- what a holder believes of a kept status ----------------------------------------------


class _Adopted:
    """What escrowd.programs asks of an adopted session (its record's fields)."""

    def __init__(self, pid: int, start_time: float | None) -> None:
        self.owner, self.id, self.key = OWNER, "orphan", (OWNER, "orphan")
        self.child_pid, self.child_start_time = pid, start_time
        self.started, self.exit_status = True, None

    def persist(self) -> None:
        pass

    def log(self, event: str, **fields: object) -> None:
        pass


def _orphan(tmp_path: Path) -> tuple[int, float]:
    """A real process that is not this one's child (its parent exited), already ended."""
    out = subprocess.run(["sh", "-c", "sleep 0.2 & echo $!"], capture_output=True, text=True,
                         check=True)
    pid = int(out.stdout)
    start_time = process_start_time(pid)
    assert start_time is not None
    wait_for(lambda: not psutil.pid_exists(pid), 5, "the orphan to end and be reaped")
    return pid, start_time


def _ending(exits: Path, pid: int, start_time: float | None) -> object:
    registry = Registry(10, 1 << 16, 1 << 20, 10)
    session = _Adopted(pid, start_time)
    registry.live[session.key] = session  # type: ignore[assignment]
    programs = Programs(registry, str(exits))
    programs.adopt([session])  # type: ignore[list-item]
    [watched] = programs._watched
    return programs._ending(watched)


def _kept(pid: int, start_time: float, code: int = 3) -> bytes:
    return msgspec.msgpack.encode(orphans.Kept(pid=pid, start_time=start_time,
                                               status=protocol.ExitStatus(code=code)))


def test_a_kept_status_is_believed_only_when_it_is_the_programs(tmp_path: Path) -> None:
    exits = tmp_path / "escrowd.sock.exits"
    pid, start_time = _orphan(tmp_path)
    assert _ending(exits, pid, start_time) == "unknown"  # nobody kept one: never a guess
    exits.mkdir(mode=0o700)
    forged = {
        "wrong start time": (_kept(pid, start_time + 5.0), 0o600),
        "open to others": (_kept(pid, start_time), 0o644),
        "garbage": (b"\x93garbage", 0o600),
        "another pid": (_kept(pid + 1, start_time), 0o600),
    }
    for why, (data, mode) in forged.items():
        path = exits / f"{pid}-{why.replace(' ', '_')}"
        path.write_bytes(data)
        path.chmod(mode)
        assert _ending(exits, pid, start_time) == "unknown", why
        path.unlink()
    (tmp_path / "elsewhere").write_bytes(_kept(pid, start_time))
    (exits / f"{pid}-link").symlink_to(tmp_path / "elsewhere")
    assert _ending(exits, pid, start_time) == "unknown"  # a link is never followed
    (exits / f"{pid}-link").unlink()
    assert _ending(exits, pid, None) == "unknown"  # no start time: nothing ties it
    orphans.keep(str(exits), orphans.Kept(pid=pid, start_time=start_time,
                                          status=protocol.ExitStatus(code=3)))
    assert _ending(exits, pid, start_time) == protocol.ExitStatus(code=3)
    assert os.listdir(exits) == []  # taken
    exits.chmod(0o755)  # a directory others could open: the keeper writes nothing there
    with pytest.raises(PermissionError):
        orphans.keep(str(exits), orphans.Kept(pid=pid, start_time=start_time,
                                              status=protocol.ExitStatus(code=3)))


def test_an_adopted_pid_that_is_now_another_programs_is_never_waited_for(
    tmp_path: Path,
) -> None:
    """The adopted program's pid is reused by a child of this very process (one the holder
    started since, say): it is another process (its start time says so), never reaped for
    the adopted one's status."""
    child = subprocess.Popen(["sh", "-c", "exit 9"])
    try:
        wait_for(lambda: psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE, 5,
                 "the child to end, unreaped")
        start_time = process_start_time(child.pid)
        assert start_time is not None
        assert _ending(tmp_path / "exits", child.pid, start_time - 10.0) == "unknown"
    finally:
        assert child.wait(5) == 9  # still there to be reaped by its own parent


def test_a_marked_programs_kept_status_is_never_trimmed(tmp_path: Path) -> None:
    exits = str(tmp_path / "escrowd.sock.exits")
    orphans.mark(exits, 4242, 1000.0)
    orphans.keep(exits, orphans.Kept(pid=4242, start_time=1000.0,
                                     status=protocol.ExitStatus(code=6)))
    for pid in range(5000, 5000 + orphans._MAX_KEPT + 5):  # leftovers nobody marked
        orphans.keep(exits, orphans.Kept(pid=pid, start_time=1.0,
                                         status=protocol.ExitStatus(code=0)))
    assert len(os.listdir(exits)) == orphans._MAX_KEPT + 2
    assert orphans.take(exits, 4242, 1000.0) == protocol.ExitStatus(code=6)
    orphans.unmark(exits, 4242, 1000.0)
    assert not orphans.marked(exits, 4242, 1000.0)


def test_a_started_programs_first_record_says_started() -> None:
    """The record a holder that dies at once leaves: adopted, the session is a started
    program's (its status is waited for), never an app's."""
    registry = Registry(8, 1 << 16, 1 << 20, 8)
    master, slave = os.openpty()
    os.close(slave)
    session = Session(OWNER, protocol.Deposit(id="first", child_pid=os.getpid()), master,
                      registry.new_ring(), None, None, 123.0, started=True)
    try:
        record = session.ring.state.record()
        assert record is not None
        assert (record.started, record.child_start_time) == (True, 123.0)
    finally:
        session.close()


@given(st.binary(max_size=600))
def test_the_kept_status_parser_takes_anything(data: bytes) -> None:
    kept = orphans.parse(data)
    assert kept is None or (kept.status.code is None) != (kept.status.signal is None)


@pytest.mark.parametrize("forged", [{"code": 1, "signal": 9}, {"code": 300}, "dead"])
def test_a_stored_exit_status_that_is_no_status_is_not_believed(forged: object) -> None:
    """The holder's state file keeps a session's exit status across a restart; a record whose
    status breaks its type (both a code and a signal, a code past 255, a word that is no
    status) does not decode, and the record before it stands for the next holder."""
    state = StateFile.create(Record, 4096, "escrowd:session:test")
    try:
        good = Record(token="t", owner=OWNER, id="s", started=True,
                      exit_status=protocol.ExitStatus(code=3))
        state.write(good)
        state.write(msgspec.structs.replace(good, exit_status=forged, label="forged"))
        again = StateFile(os.dup(state.fd), Record)  # as the next holder maps it
        try:
            assert again.record() == good
        finally:
            again.close()
    finally:
        state.close()
