"""A C custody owed an answer keeps its connection, and never takes one call's answer for
another's (client/c/escrow_resume.c, escrow_retrieve_many.c, escrow_reclaim.c,
escrow_custody_end.c; PROTOCOL.md 5, 10.2, 10.4 and 12.6).

Closing a custody's connection ends custody of every session on it: a holder that lives
drains them while the app still reads them (two readers, a replay with gaps). So a call
into custody that times out, a retrieve and a reclaim's survey included, leaves the
connection open, owed its answer, and the next call reads that answer first; a call that
finds it still owed sends nothing, keeps nothing, and says `busy`, which an app can tell
from a deposit kept in doubt (`unresponsive`). Each is a real holder SIGSTOPped past the
client's timeout and SIGCONTed, driven through the driver's custody-script.
"""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import Callable

from test_c_client import Build, FakeHolder, read, run_c, send
from test_c_client import build as build  # noqa: F401  (a fixture)
from test_c_client import fake as fake  # noqa: F401  (a fixture)
from test_c_custody import (  # noqa: F401
    Script,
    _said,
    greet_keep,
    held_by,
    script,
    scripts,
    session_info,
    state_of,
)
from test_survive import kill_serving_holder

from conftest import HolderProcess, PtyChild, wait_for
from escrow_client import protocol

FAST = ("--drain-stop-budget", "0.3", "--send-deadline", "0.3")


def _sleeper(pty_children: Callable[..., PtyChild]) -> PtyChild:
    return pty_children(["sh", "-c", "exec sleep 600"])


def test_a_retrieve_into_custody_that_times_out_keeps_custody_of_the_others(
    build: Build, make_holder: Callable[..., HolderProcess],  # noqa: F811
    pty_children: Callable[..., PtyChild], scripts: list[Script],  # noqa: F811
) -> None:
    """Found in review: a retrieve into custody that got no answer in time closed the
    custody's connection, so the holder drained s1 while the app still read it. Now s1
    stays held by the app; the late handoff of s2 is closed unacked, the holder's wait for
    the ack ended by a status, and s2 is back in escrow, where a retrieve takes it."""
    holder = make_holder(*FAST)
    kids = [_sleeper(pty_children) for _ in range(2)]
    client = holder.client()
    client.hand_off("s2", kids[1].master, child_pid=kids[1].pid)
    app = script(scripts, build, holder.socket, pass_fds=(kids[0].master,))
    _said(app.call(f"deposit s1 {kids[0].master} 1"), "ok", 1)
    os.kill(holder.pid, signal.SIGSTOP)
    try:
        _said(app.call("retrieve s2 1"), "unresponsive", 0)
    finally:
        os.kill(holder.pid, signal.SIGCONT)
    wait_for(lambda: state_of(client, "s2") == "handing_off", 10.0, "the late handoff")
    assert held_by(client, "s1", app.proc.pid), client.list()
    assert app.call("holds s1")["fd"] == 1
    _said(app.call("update s1 80 24"), "ok", 1)  # the late answers read first
    wait_for(lambda: state_of(client, "s2") == "draining", 10.0, "s2 put back")
    assert held_by(client, "s1", app.proc.pid), client.list()
    got = app.call("retrieve s2")
    _said(got, "ok", 1)
    assert got["fd"] >= 3
    app.end()
    assert state_of(client, "s1") == "draining"


def test_a_reclaim_into_a_custody_owed_an_answer_reads_it_first_or_sends_nothing(
    build: Build, make_holder: Callable[..., HolderProcess],  # noqa: F811
    pty_children: Callable[..., PtyChild], scripts: list[Script],  # noqa: F811
) -> None:
    """Found in review: escrow_custody_reclaim_all asked its status on a custody owed the
    answer to an update, took that `updated` for the status's answer, and lost the
    connection (s1 drained while the app read it); with the holder still stopped, it
    timed out and closed it. Now, still owed, it sends nothing and says busy; once the
    late answer is there it is read first, and the reclaim runs on the same connection."""
    holder = make_holder(*FAST)
    kid = _sleeper(pty_children)
    client = holder.client()
    app = script(scripts, build, holder.socket, pass_fds=(kid.master,))
    _said(app.call(f"deposit s1 {kid.master} 1"), "ok", 1)
    os.kill(holder.pid, signal.SIGSTOP)
    try:
        _said(app.call("update s1 81 24"), "unresponsive", 0)
        _said(app.call("reclaim 1"), "busy", 0, "s1")
        _said(app.call("retrieve s9"), "busy", 0, "s9")
    finally:
        os.kill(holder.pid, signal.SIGCONT)
    wait_for(lambda: any(s.id == "s1" and s.cols == 81 for s in client.list()), 10.0,
             "the late update")
    got = app.call("reclaim 1")
    _said(got, "ok", 1)
    assert got["fd"] == 0  # s1 is held here: not taken
    assert held_by(client, "s1", app.proc.pid), client.list()
    app.end()
    assert state_of(client, "s1") == "draining"


def test_a_deposit_while_an_answer_is_owed_is_busy_and_keeps_nothing(
    build: Build, make_holder: Callable[..., HolderProcess],  # noqa: F811
    pty_children: Callable[..., PtyChild], scripts: list[Script],  # noqa: F811
) -> None:
    """Found in review: a deposit refused, nothing sent, because an earlier call was still
    owed its answer said `unresponsive`, as a deposit kept in doubt does, and kept
    nothing: an app took it for protected. Now it is `busy`, escrow_custody_holds says 0,
    and a deposit once the answer came escrows it."""
    holder = make_holder(*FAST)
    kids = [_sleeper(pty_children) for _ in range(2)]
    client = holder.client()
    app = script(scripts, build, holder.socket, pass_fds=tuple(k.master for k in kids))
    _said(app.call(f"deposit s1 {kids[0].master}"), "ok", 1)
    os.kill(holder.pid, signal.SIGSTOP)
    try:
        _said(app.call("update s1 81 24"), "unresponsive", 0)
        _said(app.call(f"deposit s2 {kids[1].master}"), "busy", 0, "s2")
        assert app.call("holds s2")["fd"] == 0
        assert app.call("holds s1")["fd"] == 1
    finally:
        os.kill(holder.pid, signal.SIGCONT)
    wait_for(lambda: any(s.id == "s1" and s.cols == 81 for s in client.list()), 10.0,
             "the late update")
    _said(app.call(f"deposit s2 {kids[1].master}"), "ok", 1)
    assert app.call("holds s2")["fd"] == 1
    assert held_by(client, "s2", app.proc.pid)
    app.end()


def test_closing_a_custody_whose_holder_restarted_unnoticed_is_confirmed(
    build: Build, make_holder: Callable[..., HolderProcess],  # noqa: F811
    pty_children: Callable[..., PtyChild], scripts: list[Script],  # noqa: F811
) -> None:
    """Found in review: a custody that had not seen its holder go (SIGKILLed, the keeper's
    next one adopting s1 as held by this process) was closed without a confirmation, and
    said ok while s1 stayed held by nobody. Now every close with sessions held is
    confirmed by the holder's list: s1 is taken back and its custody ended, draining."""
    holder = make_holder(keeper=True)
    kid = _sleeper(pty_children)
    client = holder.client()
    app = script(scripts, build, holder.socket, timeout=5.0, pass_fds=(kid.master,))
    _said(app.call(f"deposit s1 {kid.master}"), "ok", 1)
    kill_serving_holder(holder)
    wait_for(lambda: held_by(client, "s1", app.proc.pid), 10.0, "s1 adopted, held for us")
    _said(app.call("close"), "ok", 0)
    assert state_of(client, "s1") == "draining"
    app.end()


def test_an_ack_late_into_custody_is_asked_about_again_and_the_late_done_keeps_it(
    build: Build, fake: Callable[..., FakeHolder], scripts: list[Script],  # noqa: F811
) -> None:
    """Found in review: into custody, our `done` slow, the ack sent again on a fresh
    connection got `ack_late`, which a real holder answers for a session already held:
    by our own custody connection, where the first ack completed meanwhile. The client
    took it for a session drained again and closed its copy, and the late `done` left the
    session held there with nobody reading it. Now the list is asked again: held by this
    process, the session is kept, and the late `done` read before the next call."""
    master, slave = os.openpty()
    requests: list[protocol.Request] = []
    holder: list[FakeHolder] = []

    def accept() -> socket.socket:
        conn, _ = holder[0].listener.accept()
        greet_keep(conn)
        return conn

    def custody(conn: socket.socket) -> None:
        pid = greet_keep(conn)
        assert read(conn) == protocol.Retrieve(id="s1", keep=True)
        send(conn, protocol.Handoff(handoff_id="h-1", session=session_info("draining"),
                                    replay=b"R\r\n"), fd=master)
        assert isinstance(read(conn), protocol.Ack)
        with accept() as asking:
            assert isinstance(read(asking), protocol.List)
            send(asking, protocol.Sessions(sessions=[session_info(
                "handing_off", handoff_id="h-1", custodian_pid=pid)]))
        with accept() as again:
            assert read(again) == protocol.Ack(id="s1", handoff_id="h-1")
            # Our first ack completes here meanwhile: held by this connection.
            send(again, protocol.Error(code="ack_late", message="no handoff waits", id="s1"))
        with accept() as asking:
            assert isinstance(read(asking), protocol.List)
            send(asking, protocol.Sessions(sessions=[session_info("held", custodian_pid=pid)]))
        send(conn, protocol.Done(id="s1"))
        requests.append(read(conn))
        send(conn, protocol.Updated(id="s1"))
        conn.settimeout(20)
        assert conn.recv(1) == b"", "custody ends only when the app ends it"

    holder.append(fake([custody]))
    try:
        app = script(scripts, build, holder[0].path)
        got = app.call("retrieve s1")
        _said(got, "ok", 0)  # owed its `done`: not known yet
        assert got["fd"] >= 3
        assert app.call("holds s1")["fd"] == 1
        _said(app.call("update s1 80 24"), "ok", 1)  # the late done read first
        app.end()
    finally:
        os.close(master)
        os.close(slave)
    assert [type(r).__name__ for r in requests] == ["Update"]


def test_a_hand_off_whose_deposit_went_unanswered_is_what_its_close_confirmed(
    build: Build, fake: Callable[..., FakeHolder],  # noqa: F811
) -> None:
    """Found in review: escrow_hand_off returned its deposit's `unresponsive` although the
    close that followed confirmed the session draining (the hand-off done), where the
    Python client's hand_off succeeds once the close confirms. Now it returns that."""
    def custody(conn: socket.socket) -> None:
        greet_keep(conn)
        assert isinstance(read(conn), protocol.Deposit)
        conn.settimeout(20)
        assert conn.recv(1) == b""  # no answer: the client's end of custody

    def listing(conn: socket.socket) -> None:
        greet_keep(conn)
        assert isinstance(read(conn), protocol.List)
        send(conn, protocol.Sessions(sessions=[session_info("draining")]))

    holder = fake([custody, listing])
    r, w = os.pipe()
    try:
        run = run_c(build, holder.path, "hand-off", "s1", str(r), timeout=1.0, pass_fds=(r,))
    finally:
        os.close(r)
        os.close(w)
    assert run.status == 0, run.err
