"""The client trusts only its own holder (docs/design.md §8 and §10).

Incident pinned: with XDG_RUNTIME_DIR unset, another local user pre-created
`/tmp/escrowd-<victim uid>/` (mode 0777) and listened there; the victim's ordinary
`hand_off` gave that listener the PTY master, which typed `id > /tmp/x` into the victim's
shell. `escrowctl status` called the fake holder `running`.

Every test here runs a real second user (see otheruser.py) and checks that the client says
`forbidden`, naming what was wrong, and that the listener received no fd and no byte.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from otheruser import FakeHolder, OtherUser, other_user, squat

from conftest import OWNER, PtyChild, require_program
from escrow_client import EscrowClient, Forbidden, autostart
from escrow_client.cli import STATUS_EXIT_CODES

ESCROWCTL = str(Path(sys.executable).parent / "escrowctl")


@pytest.fixture
def user() -> OtherUser:
    return other_user()


@pytest.fixture
def base() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="esc-trust-"))
    os.chmod(d, 0o755)  # others may reach what is inside, as in /tmp
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def fakes() -> Iterator[list[FakeHolder]]:
    started: list[FakeHolder] = []
    yield started
    for fake in started:
        fake.stop()


def squatted_listener(base: Path, user: OtherUser, mode: int,
                      fakes: list[FakeHolder]) -> tuple[str, FakeHolder]:
    directory = base / f"escrowd-{os.getuid()}"
    squat(directory, user, mode)
    path = str(directory / "escrowd.sock")
    fake = FakeHolder(user, path=path)
    fakes.append(fake)
    return path, fake


def escrowctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([ESCROWCTL, *args], capture_output=True, text=True, timeout=30,
                          stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("mode", [0o777, 0o700], ids=["0777", "0700"])
def test_a_directory_squatted_by_another_user_gets_no_terminal(
    user: OtherUser, base: Path, fakes: list[FakeHolder], mode: int,
    pty_children: Callable[..., PtyChild],
) -> None:
    """The attack itself: another uid owns the socket's directory (open to all, or its own
    0700, which root still enters) and listens there. hand_off raises Forbidden naming the
    directory, its owner and the uid expected, before connecting: the listener sees no
    connection, no byte, no fd."""
    path, fake = squatted_listener(base, user, mode, fakes)
    kid = pty_children(["sh", "-c", "sleep 30"])
    client = EscrowClient(OWNER, socket_path=path)
    with pytest.raises(Forbidden) as refused:
        client.hand_off("tab", kid.master, child_pid=kid.pid)
    message = str(refused.value)
    assert refused.value.code == "forbidden"
    assert os.path.dirname(path) in message
    assert f"owned by uid {user.uid}" in message and f"uid {os.getuid()}" in message
    with pytest.raises(Forbidden):
        client.list()
    events = fake.stop()
    assert fake.fds_received() == 0 and fake.bytes_received() == 0
    assert [e for e in events if e["event"] == "connection"] == []


def test_a_listener_of_another_uid_in_our_own_directory_gets_no_byte(
    user: OtherUser, base: Path, fakes: list[FakeHolder],
    pty_children: Callable[..., PtyChild],
) -> None:
    """The directory is ours and private, but the process listening in it runs as another
    uid (it was handed the bound socket). The client connects, reads the listener's uid
    (SO_PEERCRED), and refuses before sending its hello: the listener sees a connection
    and no frame, no byte, no fd."""
    directory = base / "ours"
    directory.mkdir(mode=0o700)
    path = str(directory / "escrowd.sock")
    bound = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    bound.bind(path)
    fake = FakeHolder(user, bound=bound)
    bound.close()
    fakes.append(fake)
    kid = pty_children(["sh", "-c", "sleep 30"])
    with pytest.raises(Forbidden) as refused:
        EscrowClient(OWNER, socket_path=path).hand_off("tab", kid.master, child_pid=kid.pid)
    assert f"runs as uid {user.uid}" in str(refused.value)
    assert f"your own uid {os.getuid()}" in str(refused.value)
    fake.wait_event("eof")  # the client hung up; it sent nothing first
    fake.stop()
    assert fake.fds_received() == 0 and fake.bytes_received() == 0
    assert [e["event"] for e in fake.events] == ["connection", "eof"]


PROBE = (3).to_bytes(4, "big") + b"end"  # a frame no client sends


def connections_before_a_probe(fake: FakeHolder, path: str, timeout: float = 10.0) -> int:
    """How many connections `fake` took before one of the test's own, which sends PROBE.
    The listener takes connections one at a time, in order: once it reports the probe's
    frame, it has reported every connection made before it. (Killed if it has not within
    `timeout`, which ends the wait.)"""
    deadline = threading.Timer(timeout, fake.proc.kill)
    deadline.start()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.connect(path)
            probe.sendall(PROBE)
            while fake.wait_event("frame")["bytes"] != len(PROBE):
                pass
    finally:
        deadline.cancel()
    return sum(e["event"] == "connection" for e in fake.events) - 1


def attempt(call: Callable[[], object]) -> Exception | None:
    """What `call` raised, or None."""
    try:
        call()
    except Exception as exc:
        return exc
    return None


@pytest.mark.parametrize("mode", [0o770, 0o720], ids=["0770", "0720"])
def test_our_own_directory_that_the_group_may_write_gets_no_terminal(
    user: OtherUser, base: Path, fakes: list[FakeHolder], mode: int,
    pty_children: Callable[..., PtyChild],
) -> None:
    """The directory is ours, but its group may write it (0770; or 0720, write without
    search, which a chmod may have left): any member of the group may have put a listener
    there, or put one in place of our holder's. Here a member of the group did (while the
    directory was 0770). hand_off raises Forbidden naming the mode before connecting: the
    listener sees no connection."""
    directory = base / "ours"
    directory.mkdir(mode=0o700)
    os.chown(directory, os.getuid(), user.gid)
    os.chmod(directory, 0o770)
    path = str(directory / "escrowd.sock")
    fakes.append(fake := FakeHolder(user, path=path))
    os.chmod(directory, mode)
    kid = pty_children(["sh", "-c", "sleep 30"])
    refused = attempt(lambda: EscrowClient(OWNER, socket_path=path).hand_off(
        "tab", kid.master, child_pid=kid.pid))
    assert connections_before_a_probe(fake, path) == 0, \
        "the client connected to a listener in a directory its group may write"
    fake.stop()
    assert fake.fds_received() == 0 and fake.bytes_received() == len(PROBE)
    assert isinstance(refused, Forbidden), refused
    message = str(refused)
    assert f"has mode {mode:04o}" in message and "writable by group or others" in message
    assert str(directory) in message


def test_a_directory_of_another_uid_closed_to_writes_is_refused_for_its_owner(
    user: OtherUser, base: Path, fakes: list[FakeHolder],
    pty_children: Callable[..., PtyChild],
) -> None:
    """Another uid owns the socket's directory, mode 0755 (no one else may write it), and
    the listener in it runs as our own uid: the mode and the peer's uid pass. The owner
    does not: whoever owns the directory may replace what listens there at any time.
    hand_off raises Forbidden naming the owner; the listener sees no connection."""
    directory = base / f"escrowd-{os.getuid()}"
    squat(directory, user, 0o755)
    path = str(directory / "escrowd.sock")
    ourselves = OtherUser(pwd.getpwuid(os.getuid()).pw_name, os.getuid(), os.getgid())
    fakes.append(fake := FakeHolder(ourselves, path=path))  # (as root, it may bind there)
    kid = pty_children(["sh", "-c", "sleep 30"])
    refused = attempt(lambda: EscrowClient(OWNER, socket_path=path).hand_off(
        "tab", kid.master, child_pid=kid.pid))
    assert connections_before_a_probe(fake, path) == 0, \
        "the client connected to a listener in a directory another uid owns"
    fake.stop()
    assert fake.fds_received() == 0 and fake.bytes_received() == len(PROBE)
    assert isinstance(refused, Forbidden), refused
    message = str(refused)
    assert f"owned by uid {user.uid}" in message and f"your own uid {os.getuid()}" in message


def test_autostart_refuses_to_start_a_holder_in_a_squatted_directory(
    user: OtherUser, base: Path,
) -> None:
    """A squatted directory with nothing listening yet: autostart would start our holder
    there (where the squatter could replace its socket). It refuses with the same error."""
    directory = base / f"escrowd-{os.getuid()}"
    squat(directory, user, 0o777)
    before = autostart.spawned
    with pytest.raises(Forbidden) as refused:
        EscrowClient(OWNER, socket_path=str(directory / "escrowd.sock"), autostart=True).list()
    assert f"owned by uid {user.uid}" in str(refused.value)
    assert autostart.spawned == before
    assert os.listdir(directory) == []


def test_escrowctl_says_plainly_it_will_not_talk_to_a_squatter(
    user: OtherUser, base: Path, fakes: list[FakeHolder],
) -> None:
    """status: not `running` (indeterminate), the reason in --json; list, stop and demo:
    a one-line `forbidden` refusal, no traceback; the listener gets nothing."""
    path, fake = squatted_listener(base, user, 0o777, fakes)
    status = escrowctl("--socket", path, "status", "--json")
    verdict = json.loads(status.stdout)
    assert status.returncode == STATUS_EXIT_CODES["indeterminate"]
    assert verdict["state"] == "indeterminate" and verdict["holder"] is None
    assert f"owned by uid {user.uid}" in verdict["reason"]
    assert verdict["evidence"]["trust"] == verdict["reason"]
    text = escrowctl("--socket", path, "status")
    assert "indeterminate" in text.stdout and f"owned by uid {user.uid}" in text.stdout
    for args in (["list"], ["stop"], ["demo"], ["release", f"{OWNER}/tab"]):
        result = escrowctl("--socket", path, *args)
        assert result.returncode != 0, args
        assert "Traceback" not in result.stderr, (args, result.stderr)
        if args != ["stop"]:
            assert "(forbidden)" in result.stderr, (args, result.stderr)
        assert f"owned by uid {user.uid}" in result.stderr, (args, result.stderr)
    fake.stop()
    assert fake.fds_received() == 0 and fake.bytes_received() == 0
    assert [e for e in fake.events if e["event"] == "connection"] == []


def test_status_of_a_listener_of_another_uid_is_not_running(
    user: OtherUser, base: Path, fakes: list[FakeHolder],
) -> None:
    """In our own directory a process of another uid answers like a holder would; status
    never asks it (no hello sent) and does not call it running."""
    directory = base / "ours"
    directory.mkdir(mode=0o700)
    path = str(directory / "escrowd.sock")
    bound = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    bound.bind(path)
    fakes.append(fake := FakeHolder(user, bound=bound))
    bound.close()
    status = escrowctl("--socket", path, "--json", "status")
    verdict = json.loads(status.stdout)
    assert verdict["state"] == "indeterminate", verdict
    assert status.returncode == STATUS_EXIT_CODES["indeterminate"]
    assert f"runs as uid {user.uid}" in verdict["evidence"]["trust"]
    assert verdict["evidence"]["socket_answer"] == "untrusted"
    fake.stop()
    assert fake.bytes_received() == 0


VICTIM = textwrap.dedent("""
    import json, os, sys
    from escrow_client import EscrowClient, EscrowError
    from escrow_client.paths import default_socket_path
    master, slave = os.openpty()
    result = {"socket": default_socket_path()}
    try:
        EscrowClient("com.example.term").hand_off("tab", master)
        result["outcome"] = "handed off"
    except EscrowError as exc:
        result["outcome"], result["message"] = exc.code, str(exc)
    print(json.dumps(result))
""")


def test_the_default_path_squatted_in_tmp(user: OtherUser, base: Path) -> None:
    """The incident as it happened: XDG_RUNTIME_DIR unset, the other user squats
    /tmp/escrowd-<uid> with mode 0777 and listens; the victim's plain EscrowClient refuses
    and the squatter receives nothing. The squatted directory is a tmpfs mounted over
    /tmp/escrowd-<uid> in a mount namespace of the test's own, so this machine's real one
    (and anything listening in it) is never touched."""
    unshare = require_program("unshare")
    script = base / "victim.py"
    script.write_text(VICTIM)
    report = base / "fake.json"
    uid = os.getuid()
    squatted = Path(f"/tmp/escrowd-{uid}")
    made_mountpoint = not squatted.exists()
    if made_mountpoint:
        squatted.mkdir(mode=0o700)  # what our own holder would make there; removed below
    inner = textwrap.dedent(f"""
        set -eu
        mount -t tmpfs -o mode=0777 tmpfs {squatted}
        chown {user.uid}:{user.gid} {squatted}
        {sys.executable} {Path(__file__).parent / "otheruser.py"} \\
            {squatted}/escrowd.sock {report} &
        fake=$!
        trap 'kill -TERM $fake 2>/dev/null || true' EXIT
        while [ ! -S {squatted}/escrowd.sock ]; do
            kill -0 $fake
            sleep 0.01
        done
        env -u XDG_RUNTIME_DIR -u ESCROW_SOCKET {sys.executable} {script}
        kill -TERM $fake
        wait $fake
    """)
    try:
        result = subprocess.run([unshare, "-m", "--propagation", "private", "sh", "-c", inner],
                                capture_output=True, text=True, timeout=60)
    finally:
        if made_mountpoint:
            squatted.rmdir()
    assert result.returncode == 0, result.stderr
    victim = json.loads(result.stdout.strip().splitlines()[-1])
    assert victim["socket"] == f"/tmp/escrowd-{uid}/escrowd.sock"
    assert victim["outcome"] == "forbidden", victim
    assert f"owned by uid {user.uid}" in victim["message"]
    events = [json.loads(line) for line in report.read_text().splitlines()]
    assert events == [], "the squatter saw a connection"
