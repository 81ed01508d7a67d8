"""Nothing stored is believed unchecked, and doubt never closes a terminal (docs/design.md §11,
Adoption): what another process of the user, or a bug, writes into a holder's state files
costs at most that session's record, never its terminal, the holder or another session.

Incidents pinned (each measured with one forged record, or a spoilt file, and one holder
SIGKILL): `custodian_pid` -5 or 2^40, or `handoff_peer_pid` 2^40, made every following
holder die at start (27 to 29 exits in 20 s, forever: no session listed, retrieved or
drained); a `meta` near the slot size did the same (the adopting holder's own re-write no
longer fit); `child_pid` -5 made every all-owners `list` close the connection, and a state
"bogus" made every client fail to decode it; a `capacity` of 2^40 made `list` show `exited`
with the child alive and a size of -1 GiB; a hot counter far past the layout gave a replay
of NUL bytes; a damaged fixed header (a zeroed file, an absurd layout version) got the
session refused and its healthy master closed (the shell got SIGHUP) with nothing listed;
and a record claiming another session's owner/id with a newer deposit took its name and
got the real session's master closed.

Here a real keeper runs the holder, real shells hold each terminal, the damage is done
through /proc/<holder>/fd (tests/statefiles.py), and the holder is SIGKILLed.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

import pytest
from statefiles import forge, record_of, scribble, set_total, state_files

from conftest import OWNER, HolderProcess, PtyChild, wait_for
from escrow_client import EscrowClient, EscrowError, protocol
from escrowd.statefile import BIG_SLOT
from escrowd.takeup import LOST_LABEL


# A child that prints one line naming itself, then waits (its terminal is all it has).
def marker_child(name: str) -> list[str]:
    return ["sh", "-c", f"printf 'I am {name}\\n'; exec sleep 600"]


def deposit(holder: HolderProcess, pty_children: Callable[..., PtyChild], sid: str,
            owner: str = OWNER) -> PtyChild:
    """A session handed off (draining) whose child printed its line, drained already; the
    test's own copy of the master closed, so the holder's copies are the only ones."""
    kid = pty_children(marker_child(sid))
    client = holder.client(owner)
    client.hand_off(sid, kid.master, child_pid=kid.pid)
    os.close(kid.master)
    kid.master = -1
    wait_for(lambda: _info(client, sid).buffered_bytes > 0, 10.0, f"{sid}'s line drained")
    return kid


def _info(client: EscrowClient, sid: str) -> protocol.SessionInfo:
    return next(s for s in client.list() if s.id == sid)


def kill_and_wait(holder: HolderProcess) -> protocol.HolderStatus:
    """SIGKILL the serving holder; the next one's status, once it answers. Fails at once
    if the keeper starts more than one holder for the kill (a crash loop)."""
    admin = holder.client("escrowctl", timeout=2.0)
    before = admin.status()
    starts = len(holder.log_lines("keeper_started_holder"))
    os.kill(before.pid, signal.SIGKILL)

    def next_one() -> protocol.HolderStatus | None:
        assert len(holder.log_lines("keeper_started_holder")) <= starts + 1, (
            f"the keeper restarted the holder more than once: {holder.logs()[-3000:]}")
        try:
            status = admin.status()
        except EscrowError:
            return None
        return status if status.instance != before.instance else None

    return wait_for(next_one, 20.0, "the next holder to serve")


def assert_serves(holder: HolderProcess, starts: int) -> list[protocol.SessionInfo]:
    """The holder answers `list` for every owner, and the keeper started `starts` holders
    in all (one per kill: no crash loop)."""
    listed = holder.client("escrowctl").list(all_owners=True)
    assert len(holder.log_lines("keeper_started_holder")) == starts, holder.logs()[-3000:]
    return listed


def live(listed: list[protocol.SessionInfo]) -> list[protocol.SessionInfo]:
    return [s for s in listed if s.state not in protocol.TOMBSTONE_STATES]


FORGED = {
    "custodian_pid -5": dict(state="held", custodian_pid=-5),
    "custodian_pid 2^40": dict(state="held", custodian_pid=1 << 40),
    "handoff_peer_pid 2^40": dict(state="handing_off", handoff_id="h", handoff_peer_pid=1 << 40),
    "meta near the slot size": dict(meta={f"k{i}": "v" * (BIG_SLOT // 40) for i in range(32)}),
    "state bogus": dict(state="bogus"),
    "capacity 2^40": dict(capacity=1 << 40),
    "saved_flags -1": dict(saved_flags=-1),
    "a gap past the counter": dict(gap_totals=[1 << 50]),
    "modes not a set": dict(modes=[1, 1048, 17, 0, 0, 0, 0, 0, 0, 0, 0]),
    "modes recorded past the counter": dict(modes_at=1 << 50),
    "modes pending no sequence": dict(modes_pending=b"\x1b[?25l"),
}


@pytest.mark.parametrize("fields", list(FORGED.values()), ids=list(FORGED))
def test_a_forged_record_costs_only_that_record(
    fields: dict[str, object], make_holder: Callable[..., HolderProcess],
    pty_children: Callable[..., PtyChild],
) -> None:
    """The forged session keeps its terminal (its shell lives), its name and a fresh ring
    with its replay marked lost from the start; the holder serves after one restart; the
    session beside it drains on with its replay, untouched."""
    holder = make_holder(keeper=True)
    victim = deposit(holder, pty_children, "victim")
    bystander = deposit(holder, pty_children, "bystander")
    files = state_files(holder.serving_pid())
    (path,) = [p for p in files.values() if record_of(p).id == "victim"]
    forge(path, **fields)
    kill_and_wait(holder)
    listed = {s.id: s for s in live(assert_serves(holder, 2))}
    assert set(listed) == {"victim", "bystander"}, listed
    assert listed["victim"].label == LOST_LABEL and listed["victim"].replay_gaps[:1] == [0]
    assert listed["bystander"].label == "" and listed["bystander"].buffered_bytes > 0
    assert victim.proc.poll() is None and bystander.proc.poll() is None, "a shell hung up"
    got = holder.client().retrieve("bystander")
    try:
        assert got.replay.startswith(b"I am bystander"), got.replay
    finally:
        os.close(got.fd)


def test_a_child_pid_that_cannot_be_a_pid_is_unknown(
    make_holder: Callable[..., HolderProcess], pty_children: Callable[..., PtyChild],
) -> None:
    """`child_pid` -5 (or past `pid_max`, which a deposit may name, or a sysctl may have
    lowered since): the record is believed all the same, with `child_alive` unknown, and
    every all-owners `list` answers (it closed the connection)."""
    holder = make_holder(keeper=True)
    victim = deposit(holder, pty_children, "victim")
    (path,) = state_files(holder.serving_pid()).values()
    forge(path, child_pid=-5)
    kill_and_wait(holder)
    (info,) = live(assert_serves(holder, 2))
    assert (info.label, info.child_pid, info.child_alive) == ("", None, None), info
    assert victim.proc.poll() is None


def test_a_counter_far_past_the_layout_is_not_believed(
    make_holder: Callable[..., HolderProcess], pty_children: Callable[..., PtyChild],
) -> None:
    """A hot counter 2^61 in a ring that could still grow: a replay of whatever the
    mapping holds (NUL bytes) with 2.3e18 dropped, were it believed."""
    holder = make_holder(keeper=True)
    victim = deposit(holder, pty_children, "victim")
    (path,) = state_files(holder.serving_pid()).values()
    set_total(path, 1 << 61)
    kill_and_wait(holder)
    (info,) = live(assert_serves(holder, 2))
    assert info.label == LOST_LABEL and info.dropped_bytes < 1 << 20, info
    assert victim.proc.poll() is None


SPOILT_HEADERS = {
    "a zeroed file": (0, bytes(8192)),
    "a ring written at offset 0": (0, b"\x1b[H\x1b[2J$ ls\r\n" * 300),
    "an absurd layout version": (8, (7777).to_bytes(4, "little")),
}


@pytest.mark.parametrize("offset, data", list(SPOILT_HEADERS.values()), ids=list(SPOILT_HEADERS))
def test_a_spoilt_header_closes_no_terminal(
    offset: int, data: bytes, make_holder: Callable[..., HolderProcess],
    pty_children: Callable[..., PtyChild],
) -> None:
    """The session is adopted with what can be proven (listed under its name while a
    whole record slot still says it, else a name that says its record is lost); its shell
    lives, and its app or a user can release it."""
    holder = make_holder(keeper=True)
    victim = deposit(holder, pty_children, "victim")
    (path,) = state_files(holder.serving_pid()).values()
    scribble(path, offset, data)
    kill_and_wait(holder)
    (info,) = live(assert_serves(holder, 2))
    assert info.label == LOST_LABEL and info.replay_gaps[:1] == [0], info
    assert info.id == "victim" or (info.owner, info.id[:8]) == ("escrowd", "lost-pts")
    assert victim.proc.poll() is None, "the shell got SIGHUP"
    EscrowClient(info.owner, socket_path=holder.socket).release(info.id)
    wait_for(lambda: victim.proc.poll() is not None, 10.0, "the released shell to hang up")


def test_a_record_claiming_another_sessions_name_takes_nothing_from_it(
    make_holder: Callable[..., HolderProcess], pty_children: Callable[..., PtyChild],
) -> None:
    """Both sessions stay, each with its own terminal; the newer deposit keeps the name,
    the other is renamed, and both are reported."""
    holder = make_holder(keeper=True)
    real = deposit(holder, pty_children, "tab")
    other = deposit(holder, pty_children, "other")
    files = state_files(holder.serving_pid())
    (path,) = [p for p in files.values() if record_of(p).id == "other"]
    forge(path, id="tab", deposited_at=record_of(path).deposited_at + 1e6)
    status = kill_and_wait(holder)
    listed = live(assert_serves(holder, 2))
    assert sorted(s.id[:8] for s in listed) == ["tab", "tab.dup-"], listed
    assert status.adopted == 2 and status.adopted_renamed == 1
    assert real.proc.poll() is None and other.proc.poll() is None


def test_restart_counts_that_cannot_be_read_are_unknown(
    make_holder: Callable[..., HolderProcess], pty_children: Callable[..., PtyChild],
) -> None:
    """A corrupt holder state file beside stored sessions: how many holders came before is
    not known (null), not 0 (a total loss would read as "no restart")."""
    holder = make_holder(keeper=True)
    deposit(holder, pty_children, "tab")
    pid = holder.serving_pid()
    (holder_file,) = [f"/proc/{pid}/fd/{n}" for n in os.listdir(f"/proc/{pid}/fd")
                      if "escrowd:holder" in os.readlink(f"/proc/{pid}/fd/{n}")][:1]
    scribble(holder_file, 0, bytes(64))
    status = kill_and_wait(holder)
    assert (status.restarts, status.unclean_restarts) == (None, None)
    assert status.adopted == 1
    again = kill_and_wait(holder)
    assert (again.restarts, again.unclean_restarts) == (None, None)  # unknown stays unknown
    assert_serves(holder, 3)




def test_an_app_whose_record_was_lost_takes_its_session_back_under_its_name(
    make_holder: Callable[..., HolderProcess], pty_children: Callable[..., PtyChild],
) -> None:
    """Found in review: a session adopted without its record but under its own name (a
    whole slot still said it) could not be taken back by its app, whose custody outlived
    the holder: the claim failed on the name it already had, the holder had stopped
    reading it, and nobody read the terminal. Now the app's deposit takes it back: held by
    the app again, protected, and the holder never read it (no second reader)."""
    holder = make_holder(keeper=True)
    kid = pty_children(["sh", "-c", "exec cat"])
    custody = holder.client().custody()
    try:
        custody.deposit("victim", kid.master, child_pid=kid.pid)
        (path,) = state_files(holder.serving_pid()).values()
        forge(path, custodian_pid=-5)  # not believed: adopted without its record
        kill_and_wait(holder)
        wait_for(lambda: custody.protected, 10.0, "custody to take the session back")
        (info,) = live(holder.client().list())
        assert (info.id, info.state, info.label) == ("victim", "held", ""), info
        assert info.custodian_pid == os.getpid()
        assert not holder.log_lines("internal_error"), holder.logs()[-2000:]
        os.write(kid.master, b"typed\n")  # cat echoes it: the app reads it, the holder not
        wait_for(lambda: b"typed" in os.read(kid.master, 1024), 5.0, "the app to read")
        assert live(holder.client().list())[0].buffered_bytes == 0, "the holder read it too"
    finally:
        custody.close()
