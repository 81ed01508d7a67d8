"""The holder's log, read back from a real run (issue 4, item 7; docs/design.md §6 "Logs").

One line per event on stderr, key=value, that `shlex.split` takes apart. Every state change of
a session is exactly one `event=state` line with `session=owner/id`, the new `state` and a
`reason`; every refused peer and every bad request is one line with a reason.

The run drives sessions through every kind of change: held -> draining -> handing_off ->
handed_off; held -> released; draining -> exited (the child exits); draining -> handing_off ->
draining (a handoff that was never acked, put back); draining -> expired (--unclaimed-ttl);
plus one bad request, one refused deposit, one unsupported version, one connection over the
limit and (as root) one peer of another uid. Then every line is checked, and each action is
found to have produced exactly the lines expected of it.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
from collections.abc import Callable

from hostile import NOBODY, connect_as, frame, mp, wait_fds
from rawclient import RawClient

from conftest import OWNER, HolderProcess, PtyChild, wait_for
from escrow_client import protocol

P = protocol
SLEEPER = ["sh", "-c", "while :; do echo tick; sleep 0.05; done"]
NAME = re.compile(r"\A[A-Za-z0-9._:@-]{1,128}/[A-Za-z0-9._:@-]{1,128}\Z")


def parse(line: str) -> dict[str, str]:
    """One log line as its key=value pairs; fails on anything else."""
    fields: dict[str, str] = {}
    for part in shlex.split(line):
        key, sep, value = part.partition("=")
        assert sep and key, f"not key=value: {part!r} in {line!r}"
        assert key not in fields, f"{key} twice in {line!r}"
        fields[key] = value
    return fields


def all_lines(holder: HolderProcess) -> list[dict[str, str]]:
    lines = [parse(line) for line in holder.logs().splitlines()]
    for fields in lines:
        assert "ts" in fields and "event" in fields, fields
        float(fields["ts"])
        if fields["event"] == "state":
            assert NAME.match(fields["session"]), fields
            assert fields["state"] in P.LIVE_STATES | P.TOMBSTONE_STATES, fields
            assert fields["reason"], fields
    return lines


def transitions(lines: list[dict[str, str]], sid: str, owner: str = OWNER) -> list[tuple[str, str]]:
    return [(f["state"], f["reason"]) for f in lines
            if f["event"] == "state" and f["session"] == f"{owner}/{sid}"]


def events(lines: list[dict[str, str]], event: str) -> list[dict[str, str]]:
    return [f for f in lines if f["event"] == event]


def wait_state(holder: HolderProcess, sid: str, state: str) -> None:
    wait_for(lambda: any(s.id == sid and s.state == state for s in holder.client().list()),
             10.0, f"{sid} to be {state}")


def test_every_change_and_refusal_is_one_line_with_a_reason(
    make_holder: Callable[..., HolderProcess], pty_children: Callable[..., PtyChild]
) -> None:
    holder = make_holder("--max-connections", "3")

    # held -> draining -> handing_off -> handed_off
    kid = pty_children(SLEEPER)
    with RawClient(holder.socket) as custodian:
        custodian.hello()
        custodian.send(P.Deposit(id="flow", child_pid=kid.pid), fd=kid.master)
        assert custodian.receive()[0] == P.Deposited(id="flow")
        # held -> released, on the same custodian connection
        rel = pty_children(SLEEPER)
        custodian.send(P.Deposit(id="rel"), fd=rel.master)
        assert custodian.receive()[0] == P.Deposited(id="rel")
        custodian.send(P.Release(id="rel"))
        assert custodian.receive()[0] == P.Released(id="rel")
        # one refused deposit: a pipe is not a terminal
        r, w = os.pipe()
        try:
            custodian.send(P.Deposit(id="pipe"), fd=r)
            reply, _ = custodian.receive()
            assert isinstance(reply, P.Error) and reply.code == "not_a_terminal"
        finally:
            os.close(r)
            os.close(w)
        # one bad request: an unknown type
        custodian.send_bytes(frame(mp({"type": "frobnicate"})))
        reply, _ = custodian.receive()
        assert isinstance(reply, P.Error) and reply.code == "bad_request"
        custodian.sock.shutdown(socket.SHUT_WR)
        assert custodian.sock.recv(1) == b""  # the holder ended custody and closed
    wait_state(holder, "flow", "draining")
    with RawClient(holder.socket) as app:
        app.hello()
        handoff, fd = app.retrieve_handoff("flow")
        app.send(P.Ack(id="flow", handoff_id=handoff.handoff_id))
        assert app.receive()[0] == P.Done(id="flow")
        app.close_fd(fd)
    flow_id = handoff.handoff_id

    # draining -> handing_off -> draining: the app took the fd and vanished without an ack
    failed = pty_children(SLEEPER)
    holder.client().hand_off("fail", failed.master, child_pid=failed.pid)
    with RawClient(holder.socket) as app:
        app.hello()
        failed_handoff, fd = app.retrieve_handoff("fail")
    wait_for(lambda: len([t for t in transitions(all_lines(holder), "fail")
                          if t[0] == "draining"]) == 2, 10.0, "the failed handoff put back")

    # draining -> exited: the child exits, the terminal hangs up
    short = pty_children(["sh", "-c", "echo bye"])
    holder.client().hand_off("short", short.master, child_pid=short.pid)
    wait_state(holder, "short", "exited")

    # an unsupported version
    with RawClient(holder.socket) as old:
        old.send(P.Hello(version=7, owner=OWNER))
        reply, _ = old.receive()
        assert isinstance(reply, P.Error) and reply.code == "unsupported_version"

    # a connection over the limit (3): two open and silent, the third gets `limit`
    with RawClient(holder.socket) as a, RawClient(holder.socket) as b:
        a.hello()
        b.hello()
        with RawClient(holder.socket) as c, RawClient(holder.socket) as d:
            c.hello()
            reply, _ = d.receive()
            assert isinstance(reply, P.Error) and reply.code == "limit"

    # a peer of another uid (as root)
    refused_peer = os.geteuid() == 0
    if refused_peer:
        _, closed = connect_as(NOBODY, holder)
        assert closed

    # Release what is left, then read the whole log back.
    holder.client().release("fail")
    holder.client().release("short")
    wait_fds(holder, 0)
    lines = all_lines(holder)

    flow = transitions(lines, "flow")
    assert [s for s, _ in flow] == ["held", "draining", "handing_off", "handed_off"], flow
    assert flow[0][1] == "deposited"
    assert flow[3][1] == f"acked handoff_id={flow_id}"
    assert re.fullmatch(r"custodian gone conn=\d+", flow[1][1]), flow
    assert re.fullmatch(rf"retrieve handoff_id={flow_id} peer_pid=\d+", flow[2][1]), flow

    rel_lines = transitions(lines, "rel")
    assert rel_lines[0] == ("held", "deposited")
    assert rel_lines[1][0] == "released" and rel_lines[1][1].startswith("release from peer_pid=")
    assert len(rel_lines) == 2, rel_lines

    fail = transitions(lines, "fail")
    assert [s for s, _ in fail] == ["held", "draining", "handing_off", "draining", "released"]
    assert fail[2][1].startswith(f"retrieve handoff_id={failed_handoff.handoff_id} ")
    assert fail[3][1] in ("no ack: peer closed", "handoff send failed: peer closed"), fail

    short_lines = transitions(lines, "short")
    assert [s for s, _ in short_lines] == ["held", "draining", "exited", "released"]
    assert short_lines[2][1] == "terminal hung up"

    (refused_deposit,) = events(lines, "deposit_refused")
    assert refused_deposit["session"] == f"{OWNER}/pipe"
    assert refused_deposit["code"] == "not_a_terminal"
    assert refused_deposit["reason"] == "the deposited fd is not a PTY master"
    assert transitions(lines, "pipe") == [], "a refused deposit is never a session"

    bad = events(lines, "bad_request")
    assert len(bad) == 2, bad  # the unknown type and the unsupported version
    assert bad[0]["owner"] == OWNER and bad[0]["conn"] and bad[0]["peer_pid"]
    assert bad[0]["reason"].startswith("invalid message:") and "frobnicate" in bad[0]["reason"]
    assert bad[1]["code"] == "unsupported_version" and bad[1]["reason"] == "unsupported version 7"

    (over,) = events(lines, "conn_refused")
    assert over["reason"] == "connection limit"

    peers = events(lines, "peer_refused")
    if refused_peer:
        (peer,) = peers
        assert peer["peer_uid"] == str(NOBODY) and peer["reason"] == "uid differs from the holder's"
    else:
        assert peers == []

    # Nothing else went wrong, and nothing about a session lacks its session=owner/id.
    assert events(lines, "internal_error") == [] and events(lines, "conn_error") == []
    for fields in lines:
        if fields["event"] in ("state", "deposit_refused", "ack_late", "read_error"):
            assert NAME.match(fields["session"]), fields


def test_an_expiry_is_one_line_with_its_reason(
    make_holder: Callable[..., HolderProcess], pty_children: Callable[..., PtyChild]
) -> None:
    holder = make_holder("--unclaimed-ttl", "0.3")
    kid = pty_children(SLEEPER)
    holder.client().hand_off("exp", kid.master, child_pid=kid.pid)
    wait_state(holder, "exp", "expired")
    wait_fds(holder, 0)
    lines = all_lines(holder)
    exp = transitions(lines, "exp")
    assert [s for s, _ in exp] == ["held", "draining", "expired"], exp
    assert exp[2][1] == "unclaimed for 0.3s"
    assert re.fullmatch(r"custodian gone conn=\d+", exp[1][1]), exp


def test_peer_text_in_a_reason_does_not_break_a_line(
    make_holder: Callable[..., HolderProcess],
) -> None:
    """A bad request's reason quotes the peer's own bytes back (msgspec names the invalid
    value). Quotes, spaces, '=', backslashes and newlines must not break the line apart, and
    a huge value must not make a line that no longer splits (the log cuts lines at 4000
    bytes, which would leave a quote open): the holder bounds what it repeats."""
    holder = make_holder()
    odd = 'a "b" c=d\\e\nf\''
    with RawClient(holder.socket) as raw:
        raw.hello()
        for value in (odd, "x" * 100_000):
            raw.send_bytes(frame(mp({"type": value})))
            reply, _ = raw.receive()
            assert isinstance(reply, P.Error) and reply.code == "bad_request"
            assert len(reply.message) < 1000, len(reply.message)
    lines = all_lines(holder)  # every line splits into key=value pairs
    first, second = events(lines, "bad_request")
    # (A newline is written as backslash-n: the line stays one line.)
    shown = odd.replace("\n", "\\n")
    assert first["reason"] == f"invalid message: Invalid value '{shown}' - at `$.type`"
    assert second["reason"].startswith("invalid message: Invalid value 'xxx")
    assert len(second["reason"]) < 1000


def test_client_strings_cannot_steer_the_log(
    make_holder: Callable[..., HolderProcess], pty_children: Callable[..., PtyChild],
) -> None:
    """Incident pinned: a label, a client name or a handoff id is the client's to choose,
    and went into the log as it came. Escape sequences (clear the screen, recolour, set the
    title), a C1 CSI, a bidi override and a newline followed by a forged `event=` would
    steer whoever reads a foreground holder's terminal, and break the one-line-per-event
    rule. Each is written as a visible escape: the raw log holds no control character
    but the newlines between lines, and every line splits back into its pairs."""
    holder = make_holder()
    nasty = "\x1b[2J\x1b[31mred\x9b0m\u202eevil\nts=0 event=forged"
    kid = pty_children(SLEEPER)
    client = holder.client(client_name=f"app {nasty}")
    with client.custody() as custody:
        custody.deposit("tab", kid.master, child_pid=kid.pid, label=nasty)
    with RawClient(holder.socket) as raw:
        raw.hello()
        raw.send(P.Ack(id="tab", handoff_id=nasty))
        reply, _ = raw.receive()
        assert isinstance(reply, P.Error) and reply.code == "ack_late"
    raw_log = holder.logs()
    assert not re.search("[\x00-\x09\x0b-\x1f\x7f-\x9f\u202e]", raw_log), raw_log
    lines = all_lines(holder)
    assert not events(lines, "forged") and all(f["ts"] != "0" for f in lines)
    shown = "\\x1b[2J\\x1b[31mred\\x9b0m\\u202eevil\\nts=0 event=forged"
    [held] = [f for f in lines if f["event"] == "state" and f.get("state") == "held"]
    assert held["label"] == shown
    assert held["client"] == f"app {shown}"
    [late] = events(lines, "ack_late")
    assert late["handoff_id"] == shown
