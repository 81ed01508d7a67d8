"""A second local user, for the threat model's two sides: a hostile peer of the holder, and a
hostile listener in front of the client.

The user is real (`useradd`, once, when the suite runs as root, as CI does); its processes
are real processes running under its uid. They run the system's python3 with a program
given on the command line, importing nothing from this project: the project's virtualenv
may live where another user cannot read (under /root, say).

`FakeHolder` is what an attacker would run: a listener that speaks just enough of the
protocol to look like a holder (welcome, then deposited for anything else) and reports
every connection, frame and fd it receives, one JSON line each, on its stdout.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conftest import require_program, require_real
from escrow_client import protocol

OTHER_USER = "escrow-other"


@dataclass(frozen=True)
class OtherUser:
    name: str
    uid: int
    gid: int


def other_user() -> OtherUser:
    """The second user, created if missing. Needs root; on CI its absence is a failure."""
    require_real("root (to act as a second user)", os.geteuid() == 0,
                 "run the suite as root, as CI does")
    try:
        pw = pwd.getpwnam(OTHER_USER)
    except KeyError:
        useradd = require_program("useradd")
        subprocess.run([useradd, "--system", "--no-create-home", "--shell",
                        "/usr/sbin/nologin", OTHER_USER], check=True, capture_output=True)
        pw = pwd.getpwnam(OTHER_USER)
    return OtherUser(OTHER_USER, pw.pw_uid, pw.pw_gid)


def system_python() -> str:
    """A python3 every user may run (the suite's own may be under /root)."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3"):
        if os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("python3")
    require_real("a system python3", found is not None, "install python3")
    assert found is not None
    return found


def squat(directory: Path, user: OtherUser, mode: int) -> None:
    """Make `directory` the other user's, with `mode`: what an attacker creates first."""
    directory.mkdir()
    os.chown(directory, user.uid, user.gid)
    os.chmod(directory, mode)


_FAKE_HOLDER = r"""
import array, json, os, socket, sys
target, welcome, answer = sys.argv[1], bytes.fromhex(sys.argv[2]), bytes.fromhex(sys.argv[3])
if target.startswith("fd:"):
    srv = socket.socket(fileno=int(target[3:]))
else:
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(target)
    os.chmod(target, 0o777)
srv.listen(8)  # the peer credentials a client sees are taken here: this process's uid
def report(**event):
    print(json.dumps(event), flush=True)
report(event="ready", uid=os.getuid())
def read_exactly(conn, n):
    data, fds = b"", 0
    while len(data) < n:
        chunk, anc, flags, _ = conn.recvmsg(n - len(data), socket.CMSG_SPACE(64))
        for level, kind, raw in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i"); got.frombytes(raw[: len(raw) - len(raw) % 4])
                fds += len(got)
                for fd in got:
                    os.close(fd)
        if not chunk:
            return None, fds
        data += chunk
    return data, fds
while True:
    conn, _ = srv.accept()
    report(event="connection")
    first = True
    with conn:
        while True:
            header, fds = read_exactly(conn, 4)
            if header is None:
                report(event="eof", fds=fds)
                break
            body, more = read_exactly(conn, int.from_bytes(header, "big"))
            report(event="frame", bytes=4 + len(body or b""), fds=fds + more)
            try:
                conn.sendall(welcome if first else answer)
            except OSError:
                break
            first = False
"""


class FakeHolder:
    """A listener run as `user` on `target` (a path it binds, or a socket fd it is given
    bound and makes listen). Resource handling: `stop()` ends the process."""

    def __init__(self, user: OtherUser, path: str | None = None,
                 bound: socket.socket | None = None) -> None:
        welcome = protocol.encode(protocol.Welcome(
            version=protocol.VERSION, holder_version="0.1.0", pid=4242,
            drain_stop_budget=3.0, send_deadline=1.0, ack_deadline=10.0))
        answer = protocol.encode(protocol.Deposited(id="tab"))
        target = f"fd:{bound.fileno()}" if bound is not None else str(path)
        self.proc = subprocess.Popen(
            [system_python(), "-I", "-c", _FAKE_HOLDER, target, welcome.hex(), answer.hex()],
            user=user.uid, group=user.gid, extra_groups=[], stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            pass_fds=(bound.fileno(),) if bound is not None else (),
        )
        assert self.proc.stdout is not None
        ready = json.loads(self.proc.stdout.readline() or "{}")
        if ready.get("event") != "ready":
            self.stop()
            raise AssertionError(f"the fake holder did not start: {self.proc.stderr}")
        assert ready["uid"] == user.uid
        self.events: list[dict[str, Any]] = []

    def wait_event(self, name: str) -> dict[str, Any]:
        """Block until the listener reports event `name` (the test's own timeout bounds it);
        every event read on the way is kept."""
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError(f"the fake holder ended before reporting {name}")
            event: dict[str, Any] = json.loads(line)
            self.events.append(event)
            if event["event"] == name:
                return event

    def stop(self) -> list[dict[str, Any]]:
        """End the listener; return every event it reported."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=10)
        self.events += [json.loads(line) for line in out.splitlines() if line.strip()]
        return self.events

    def fds_received(self) -> int:
        return sum(e.get("fds", 0) for e in self.events)

    def bytes_received(self) -> int:
        return sum(e.get("bytes", 0) for e in self.events)


def main(argv: list[str]) -> None:
    """`python otheruser.py PATH REPORT`: run a FakeHolder on PATH until SIGTERM, then write
    its events to REPORT (for tests that need it inside a namespace of their own)."""
    path, report = argv
    fake = FakeHolder(other_user(), path=path)
    # Blocked after the fake started: a child would inherit the blocked signal.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    signal.sigwait({signal.SIGTERM})
    events = fake.stop()
    Path(report).write_text("".join(json.dumps(e) + "\n" for e in events))


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
