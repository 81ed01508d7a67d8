"""reclaim_all at launch, and custody that a forked child of the app cannot keep alive."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from fakeholder import FakeHolder, Peer

from conftest import OWNER, HolderProcess, PtyChild, wait_for
from escrow_client import CustodyHeld, EscrowConfigError, protocol

SHELL_TICKS = ["sh", "-c", 'i=0; while :; do i=$((i+1)); echo "T$i"; sleep 0.05; done']


def _states(holder: HolderProcess) -> dict[str, str]:
    return {s.id: s.state for s in holder.client().list()}


def test_reclaim_all_takes_every_session_and_retries_custody_held(
    holder: HolderProcess, pty_children: Callable[..., PtyChild]
) -> None:
    """A relaunched app reclaims all its sessions in one call, including one whose old
    instance is still exiting (custody_held is retried inside the shared deadline)."""
    client = holder.client()
    kids = [pty_children(SHELL_TICKS) for _ in range(3)]
    for n, kid in enumerate(kids[:2]):
        client.hand_off(f"tab-{n}", kid.master, child_pid=kid.pid)
    custody = client.custody()
    custody.deposit("tab-2", kids[2].master, child_pid=kids[2].pid)
    wait_for(lambda: _states(holder) == {"tab-0": "draining", "tab-1": "draining",
                                         "tab-2": "held"}, what="two draining, one held")

    # The old instance lets go of tab-2 only once reclaim_all has met custody_held.
    def let_go_when_refused() -> None:
        wait_for(lambda: " state=handing_off " in holder.logs(), what="first handoff")
        custody.close()

    releaser = threading.Thread(target=let_go_when_refused)
    releaser.start()
    report = client.reclaim_all(deadline=8.0)
    releaser.join()
    try:
        assert report.failed == {}
        assert sorted(report.retrieved) == ["tab-0", "tab-1", "tab-2"]
        for sid, got in report.retrieved.items():
            assert got.confirmed, sid
            assert os.isatty(got.fd)
            assert got.session.child_pid == kids[int(sid[-1])].pid
        assert set(_states(holder).values()) == {"handed_off"}
    finally:
        for got in report.retrieved.values():
            os.close(got.fd)


def test_reclaim_all_reports_a_live_other_instance_as_custody_held_at_once(
    holder: HolderProcess, pty_children: Callable[..., PtyChild]
) -> None:
    """Incident pinned: launched while another instance of the app was alive and holding a
    session, reclaim_all spent 4.06 s retrying and then reported `HolderUnresponsive: not
    enough of the reclaim deadline left`, as if the holder were wedged. After the short
    grace (an old instance may be exiting), a session whose custodian process is alive is
    `CustodyHeld`, within 2 s, and stays held; the others are reclaimed."""
    kids = [pty_children(SHELL_TICKS) for _ in range(2)]
    client = holder.client()
    client.hand_off("free", kids[0].master, child_pid=kids[0].pid)
    with client.custody() as other_instance:  # this process: alive throughout
        other_instance.deposit("held", kids[1].master, child_pid=kids[1].pid)
        started = time.monotonic()
        report = client.reclaim_all()
        took = time.monotonic() - started
        print(f"reclaim_all with a live custodian took {took:.2f} s")
        try:
            assert sorted(report.retrieved) == ["free"]
            assert isinstance(report.failed["held"], CustodyHeld), report.failed
            assert took < 2.0
            assert _states(holder)["held"] == "held"
        finally:
            for got in report.retrieved.values():
                os.close(got.fd)


def test_reclaim_deadline_too_short_for_one_retrieve_is_a_config_error(
    holder: HolderProcess, pty_children: Callable[..., PtyChild]
) -> None:
    """Incident pinned: reclaim_all(deadline=2) against a healthy idle holder (drain-stop
    budget 3 s + send deadline 1 s) failed every session at once with HolderUnresponsive.
    The deadline can never fit a retrieve: EscrowConfigError, before any retrieve is sent;
    every session stays draining, untouched."""
    kids = [pty_children(SHELL_TICKS) for _ in range(3)]
    client = holder.client()
    for n, kid in enumerate(kids):
        client.hand_off(f"tab-{n}", kid.master, child_pid=kid.pid)
    with pytest.raises(EscrowConfigError) as refused:
        client.reclaim_all(deadline=2.0)
    assert "reclaim deadline 2s must exceed" in str(refused.value)
    assert set(_states(holder).values()) == {"draining"}
    assert " state=handing_off " not in holder.logs()
    counters = client.status().counters
    assert counters["handoffs"] == 0 and counters["handoffs_failed"] == 0


def test_single_retrieve_does_not_retry_custody_held(
    holder: HolderProcess, pty_children: Callable[..., PtyChild]
) -> None:
    """A plain retrieve of a held session raises CustodyHeld at once, changing nothing."""
    kid = pty_children(SHELL_TICKS)
    client = holder.client()
    with client.custody() as custody:
        custody.deposit("tab", kid.master, child_pid=kid.pid)
        try:
            client.retrieve("tab")
        except CustodyHeld as exc:
            assert exc.code == "custody_held"
        else:
            raise AssertionError("retrieve of a held session succeeded")
        assert _states(holder) == {"tab": "held"}
    wait_for(lambda: _states(holder) == {"tab": "draining"}, what="draining after custody")


def test_what_a_round_took_stays_in_the_report_when_a_later_request_of_it_fails(
    socket_dir: Path,
) -> None:
    """A holder without retrieve_many gets one request per session in a round. The first
    is handed off and done; the second is refused whole (an error naming no session, which
    ends that round's requests). The first session's fd is the caller's all the same: it is
    in `retrieved` (never in `failed`), and only the second failed."""
    master, slave = os.openpty()

    def script(peer: Peer) -> None:
        peer.expect(protocol.Status)
        peer.send(protocol.HolderStatus(pid=1, version="fake", started_at=1.0, socket="x",
                                        instance="i-1"))
        peer.expect(protocol.List)
        infos = [protocol.SessionInfo(owner=OWNER, id=sid, state="draining", deposited_at=1.5)
                 for sid in ("first", "second")]
        peer.send(protocol.Sessions(sessions=infos))
        assert peer.receive() == protocol.Retrieve(id="first")
        handed = protocol.SessionInfo(owner=OWNER, id="first", state="handing_off",
                                      deposited_at=1.5, handoff_id="h-1")
        peer.send(protocol.Handoff(handoff_id="h-1", session=handed, replay=b"R"), fd=master)
        assert peer.receive() == protocol.Ack(id="first", handoff_id="h-1")
        peer.send(protocol.Done(id="first"))
        assert peer.receive() == protocol.Retrieve(id="second")
        peer.send(protocol.Error(code="bad_request", message="not now"))
        peer.until_eof()

    try:
        with FakeHolder(socket_dir, [script]) as fake:
            report = fake.client().reclaim_all(deadline=4.0)
        try:
            assert sorted(report.retrieved) == ["first"]
            assert report.retrieved["first"].confirmed
            assert os.isatty(report.retrieved["first"].fd)
            assert sorted(report.failed) == ["second"]
            assert report.failed["second"].code == "bad_request"
        finally:
            for got in report.retrieved.values():
                os.close(got.fd)
    finally:
        os.close(master)
        os.close(slave)


APP_THAT_FORKS = textwrap.dedent("""
    import os, sys, time
    from escrow_client import EscrowClient
    socket_path, master, child_pid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    custody = EscrowClient("{owner}", socket_path=socket_path).custody()
    custody.deposit("tab", master, child_pid=child_pid)
    helper = os.fork()
    if helper == 0:          # a child of the app that does not exec: it must not keep custody
        time.sleep(60)
        os._exit(0)
    print(helper, flush=True)
    time.sleep(60)
""").format(owner=OWNER)


def test_forked_child_of_app_does_not_keep_custody(
    holder: HolderProcess, pty_children: Callable[..., PtyChild]
) -> None:
    """Incident: an app forked a helper that inherited the custody socket; when the app was
    killed, the helper kept the socket open, the holder never started draining, and the
    terminal filled up and blocked. The client closes custody sockets in forked children."""
    kid = pty_children(SHELL_TICKS)
    app = subprocess.Popen(
        [sys.executable, "-c", APP_THAT_FORKS, holder.socket, str(kid.master), str(kid.pid)],
        pass_fds=[kid.master], stdout=subprocess.PIPE,
    )
    assert app.stdout is not None
    helper_pid = int(app.stdout.readline())
    try:
        wait_for(lambda: _states(holder) == {"tab": "held"}, what="held by the app")
        app.send_signal(signal.SIGKILL)
        app.wait()
        os.close(kid.master)
        kid.master = -1
        # The forked helper is still alive, yet custody ended with the app.
        assert _alive(helper_pid)
        wait_for(lambda: _states(holder) == {"tab": "draining"}, what="draining after app death")
    finally:
        _kill(helper_pid)
        app.stdout.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
