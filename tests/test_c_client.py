"""The C client (client/c/) against a real holder, in both directions, and its error paths.

The client is built here with the system compiler, warnings as errors, into a temporary
directory: once as a plain optimised build, and once with AddressSanitizer and UBSan, which
every behaviour test runs (a leak, an overflow or undefined behaviour fails the test). With
no compiler the tests fail, naming `scripts/setup --test`, which installs one.

Where the holder must misbehave (no `done`, a garbage or forbidden answer, a holder of
another uid), a scripted fake holder stands in for it, so the test is exact rather than a
race.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hostile
import msgspec
import pytest
from hostile import COUNTER, NOBODY, assert_gap_free_from_1, numbered_lines, read_more_lines
from test_protocol_doc import doc_blocks, doc_text, hex_bytes, linux_constants, load_vectors

from conftest import OWNER, HolderProcess, PtyChild, require_real, wait_for
from escrow_client import fdpass, protocol

SOURCE = Path(__file__).resolve().parent.parent / "client" / "c"
# The library's files, each using only those before it (escrow_internal.h says what each is).
LIBRARY = ["escrow_errors.c", "escrow_codec.c", "escrow_frames.c", "escrow_connect.c",
           "escrow_journal.c", "escrow_resume.c", "escrow_custody.c", "escrow_custody_end.c",
           "escrow.c", "escrow_retrieve_many.c", "escrow_reclaim.c", "escrow_repaint.c"]
WARNINGS = ["-Wall", "-Wextra", "-Werror", "-Wpedantic", "-Wshadow", "-Wstrict-prototypes"]
SANITIZERS = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all",
              "-fno-omit-frame-pointer"]
# A sanitizer finding exits with this status (not one of the client's own codes).
SANITIZER_EXIT = 86
SANITIZER_ENV = {
    "ASAN_OPTIONS": f"detect_leaks=1:exitcode={SANITIZER_EXIT}",
    "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
}


@dataclass(frozen=True)
class Build:
    plain: Path
    sanitized: Path
    library: tuple[Path, ...]  # the library's objects (C11), as an app links them


def _compile(*args: str) -> None:
    result = subprocess.run(["cc", *args], capture_output=True, text=True, cwd=SOURCE)
    assert result.returncode == 0, f"cc {' '.join(args)} failed:\n{result.stderr}"
    assert result.stderr == "", f"cc {' '.join(args)} warned:\n{result.stderr}"


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Build:
    if shutil.which("cc") is None:
        pytest.fail("no C compiler (cc) on the PATH: run scripts/setup --test, which installs one")
    out = tmp_path_factory.mktemp("c-client")
    # The library alone, as an app would compile it: C11, and C99 too.
    for source in LIBRARY:
        stem = source.removesuffix(".c")
        _compile("-std=c11", *WARNINGS, "-O2", "-c", source, "-o", str(out / f"{stem}.o"))
        _compile("-std=c99", *WARNINGS, "-O2", "-c", source, "-o", str(out / f"{stem}99.o"))
    # The driver, linked with the library's files as an app is (it reaches the codec too).
    built = Build(out / "escrow-c", out / "escrow-c-san",
                  tuple(out / f"{source.removesuffix('.c')}.o" for source in LIBRARY))
    # ESCROW_TEST_HOOKS: the driver can stop itself in the middle of a journal write.
    driver = ["-DESCROW_TEST_HOOKS", "escrow-c.c", "vector_args.c", *LIBRARY]
    _compile("-std=c11", *WARNINGS, "-O2", *driver, "-o", str(built.plain))
    _compile("-std=c11", *WARNINGS, "-O1", "-g", *SANITIZERS, *driver, "-o",
             str(built.sanitized))
    return built


@dataclass
class Run:
    status: int
    out: bytes
    err: str
    seconds: float

    def lines(self) -> list[dict[str, Any]]:
        """The JSON lines the driver wrote on stderr."""
        return [json.loads(line) for line in self.err.splitlines() if line.startswith("{")]

    def error(self) -> dict[str, Any]:
        errors = [line for line in self.lines() if line.get("type") == "error"]
        assert len(errors) == 1, f"expected one error, got: {self.err}"
        error = errors[0]
        assert self.status == error["escrow_code"] != 0
        return error

    def json(self) -> Any:
        assert self.status == 0, self.err
        return json.loads(self.out)


def run_c(build: Build, socket_path: str | None, *args: str, timeout: float = 5.0,
          pass_fds: tuple[int, ...] = (), plain: bool = False) -> Run:
    """Run the driver (the sanitized build unless `plain`); fail on any sanitizer report."""
    argv = [str(build.plain if plain else build.sanitized), "--timeout", str(timeout)]
    if socket_path is not None:
        argv += ["--socket", socket_path]
    start = time.monotonic()
    result = subprocess.run([*argv, *args], capture_output=True, pass_fds=pass_fds,
                            env={**os.environ, **SANITIZER_ENV}, timeout=timeout + 30)
    took = time.monotonic() - start
    err = result.stderr.decode(errors="replace")
    assert result.returncode != SANITIZER_EXIT and "Sanitizer" not in err, err
    assert "runtime error" not in err, err
    assert result.returncode != 98 and "leaked_fds" not in err, f"an fd left open: {err}"
    return Run(result.returncode, result.stdout, err, took)


def expect_error(run: Run, code: str, id: str | None = None) -> dict[str, Any]:
    error = run.error()
    assert error["code"] == code, error
    if id is not None:
        assert error["id"] == id, error
    assert error["message"], "an error says why"
    return error


# --- the library as an app links it ---------------------------------------------------------------


def test_the_library_defines_the_api_and_names_no_app_could_clash_with(build: Build) -> None:
    """The objects define every function escrow.h declares, and beyond them only names with
    the escrow__ prefix of escrow_internal.h: nothing else reaches an app's link."""
    result = subprocess.run(["nm", "-g", *map(str, build.library)], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr
    lines = [line.split() for line in result.stdout.splitlines()]
    # An external symbol the objects define: "address type name" (macOS: "_escrow_list").
    defined = {f[2].removeprefix("_") for f in lines if len(f) == 3 and f[1] != "U"}
    declared = set(re.findall(r"\b(escrow_[a-z_]+)\(", (SOURCE / "escrow.h").read_text()))
    assert sorted(name for name in defined if not name.startswith("escrow__")) == sorted(declared)


# --- both directions with a real holder ---------------------------------------------------------


def counter_child(pty_children: Callable[..., PtyChild]) -> PtyChild:
    return pty_children(["sh", "-c", COUNTER])


def info_of(holder: HolderProcess, sid: str) -> protocol.SessionInfo | None:
    return next((s for s in holder.client().list() if s.id == sid), None)


def wait_draining(holder: HolderProcess, sid: str, at_least: int = 1) -> protocol.SessionInfo:
    def check() -> protocol.SessionInfo | None:
        info = info_of(holder, sid)
        if info is not None and info.state == "draining" and info.buffered_bytes >= at_least:
            return info
        return None

    info: protocol.SessionInfo = wait_for(check, 10.0, f"{sid} draining with {at_least}+ bytes")
    return info


def test_c_reads_under_custody_then_python_retrieves_every_line(
    build: Build, holder: HolderProcess, pty_children: Callable[..., PtyChild]
) -> None:
    """The C app deposits its terminal under custody and goes on reading it (L1..L5), then
    ends custody as an app does before it exits; the relaunched app (Python) takes it back.
    What C read, the replay and the live output join with no line lost or repeated."""
    child = counter_child(pty_children)
    master = child.master
    run = run_c(build, holder.socket, "app", "c-app", str(master), str(child.pid), "L5\r\n",
                pass_fds=(master,))
    os.close(master)  # the C app was the only reader; now the holder is
    child.master = -1
    assert run.status == 0, run.err
    assert run.lines() == [{"deposited": "c-app"}, {"custody_ended": "c-app"}]
    assert numbered_lines(run.out)[:5] == [1, 2, 3, 4, 5]

    wait_draining(holder, "c-app")
    got = holder.client().retrieve("c-app")
    try:
        assert got.confirmed
        assert (got.session.label, got.session.child_pid, got.session.child_alive) == (
            "sh", child.pid, True)
        assert (got.session.cols, got.session.rows) == (80, 24)
        assert got.dropped_bytes == 0
        assert_gap_free_from_1(read_more_lines(got.fd, run.out + got.replay, 3))
    finally:
        os.close(got.fd)


def test_c_hands_off_and_python_retrieves_from_the_first_line(
    build: Build, holder: HolderProcess, pty_children: Callable[..., PtyChild]
) -> None:
    child = counter_child(pty_children)
    run = run_c(build, holder.socket, "hand-off", "c-handoff", str(child.master), str(child.pid),
                pass_fds=(child.master,))
    assert run.status == 0, run.err
    os.close(child.master)  # nobody read it: the replay starts at L1
    child.master = -1
    info = wait_draining(holder, "c-handoff", len(b"L1\r\nL2\r\n"))
    assert info.child_pid == child.pid and info.custodian_pid is None
    got = holder.client().retrieve("c-handoff")
    try:
        assert got.confirmed
        assert_gap_free_from_1(read_more_lines(got.fd, got.replay, 3))
    finally:
        os.close(got.fd)


def test_python_hands_off_and_c_retrieves_acks_and_reads_live(
    build: Build, holder: HolderProcess, pty_children: Callable[..., PtyChild]
) -> None:
    child = counter_child(pty_children)
    holder.client().hand_off("py-handoff", child.master, child_pid=child.pid, label="sh",
                             meta={"cwd": "/home/ü"})
    os.close(child.master)
    child.master = -1
    wait_draining(holder, "py-handoff", len(b"L1\r\nL2\r\nL3\r\n"))

    run = run_c(build, holder.socket, "retrieve", "py-handoff", "5")
    assert run.status == 0, run.err
    (facts,) = run.lines()
    assert facts["confirmed"] is True
    session = facts["session"]
    assert (session["state"], session["child_pid"], session["handoff_id"]) == (
        "draining", child.pid, facts["handoff_id"])
    assert session["meta"] == {"cwd": "/home/ü"}
    assert facts["replay_bytes"] == session["buffered_bytes"] > 0
    numbers = numbered_lines(run.out)
    assert_gap_free_from_1(run.out)
    replay_lines = len(numbered_lines(run.out[: facts["replay_bytes"] + 1]))
    assert len(numbers) >= replay_lines + 5, "live lines after the replay"

    # The holder knows it was acked: a handed_off tombstone with that handoff id.
    tomb = info_of(holder, "py-handoff")
    assert tomb is not None and tomb.state == "handed_off"
    assert tomb.handoff_id == facts["handoff_id"]


def test_c_retrieves_an_exited_session_whole(
    build: Build, holder: HolderProcess, pty_children: Callable[..., PtyChild]
) -> None:
    """An exited session comes back with its whole tail; its master then reads EIO."""
    child = pty_children(["sh", "-c", "echo tail-1; echo tail-2"])
    holder.client().hand_off("gone", child.master, child_pid=child.pid)
    os.close(child.master)
    child.master = -1
    wait_for(lambda: (i := info_of(holder, "gone")) is not None and i.state == "exited",
             10.0, "the session to be exited")
    run = run_c(build, holder.socket, "retrieve", "gone", "1")
    assert run.out == b"tail-1\r\ntail-2\r\n"
    assert run.lines()[0]["session"]["state"] == "exited"
    assert run.status == 99, "reading on past the replay meets EIO: the terminal hung up"


def test_c_list_status_and_welcome_agree_with_python(
    build: Build, holder: HolderProcess, pty_children: Callable[..., PtyChild]
) -> None:
    child = counter_child(pty_children)
    client = holder.client()
    with client.custody() as custody:
        custody.deposit("held-1", child.master, child_pid=child.pid, label="zsh — ü", cols=120,
                        rows=40, meta={"title": "build", "cwd": "/tmp"})
        custody.release("held-1")
    listed = run_c(build, holder.socket, "list").json()
    python = spoken([msgspec.to_builtins(s) for s in client.list()])
    assert listed == {"type": "sessions", "sessions": python}
    assert listed["sessions"][0]["state"] == "released"

    status = run_c(build, holder.socket, "status").json()
    assert (status["pid"], status["socket"]) == (holder.pid, holder.socket)
    assert status["sessions_by_state"] == {"released": 1}
    assert status["limits"] == client.status().limits

    welcome = run_c(build, holder.socket, "welcome", plain=True).json()
    assert welcome == msgspec.to_builtins(client.welcome())
    listed_all = run_c(build, holder.socket, "list", "--all").json()
    assert [s["id"] for s in listed_all["sessions"]] == ["held-1"]


def test_c_releases_a_session(
    build: Build, holder: HolderProcess, pty_children: Callable[..., PtyChild]
) -> None:
    child = counter_child(pty_children)
    holder.client().hand_off("to-release", child.master, child_pid=child.pid)
    os.close(child.master)
    child.master = -1
    assert run_c(build, holder.socket, "release", "to-release").status == 0
    info = info_of(holder, "to-release")
    assert info is not None and info.state == "released"
    expect_error(run_c(build, holder.socket, "release", "to-release"), "released", "to-release")
    expect_error(run_c(build, holder.socket, "retrieve", "to-release"), "released", "to-release")


def test_c_updates_size_and_meta(
    build: Build, holder: HolderProcess, pty_children: Callable[..., PtyChild]
) -> None:
    """update (PROTOCOL.md 10.5): what is given replaces what was recorded, a nil (`-`, or
    no meta) leaves it, and a meta given replaces the whole map."""
    child = counter_child(pty_children)
    holder.client().hand_off("to-update", child.master, child_pid=child.pid, cols=80, rows=24,
                             meta={"cwd": "/a"})
    os.close(child.master)
    child.master = -1
    assert "update" in run_c(build, holder.socket, "welcome").json()["features"]

    def recorded() -> tuple[int, int, dict[str, str]]:
        info = info_of(holder, "to-update")
        assert info is not None
        return info.cols, info.rows, info.meta

    def update(*args: str) -> None:
        run = run_c(build, holder.socket, "update", "to-update", *args)
        assert run.status == 0, run.err

    update("132", "43", "cwd=/b", "title=é")
    assert recorded() == (132, 43, {"cwd": "/b", "title": "é"})
    update("-", "50")
    assert recorded() == (132, 50, {"cwd": "/b", "title": "é"})
    update("-", "-", "{}")
    assert recorded() == (132, 50, {})
    expect_error(run_c(build, holder.socket, "update", "never-seen", "1", "1"), "unknown",
                 "never-seen")
    holder.client().release("to-update")
    expect_error(run_c(build, holder.socket, "update", "to-update", "1", "1"), "released",
                 "to-update")


# --- the holder's refusals ----------------------------------------------------------------------


def test_unknown_session(build: Build, holder: HolderProcess) -> None:
    run = run_c(build, holder.socket, "retrieve", "never-seen")
    assert expect_error(run, "unknown", "never-seen")["escrow_code"] == 4


def test_custody_held(
    build: Build, holder: HolderProcess, pty_children: Callable[..., PtyChild]
) -> None:
    child = counter_child(pty_children)
    with holder.client().custody() as custody:
        custody.deposit("mine", child.master, child_pid=child.pid)
        expect_error(run_c(build, holder.socket, "retrieve", "mine"), "custody_held", "mine")
        info = info_of(holder, "mine")
        assert info is not None and info.state == "held", "a refused retrieve changes nothing"
        custody.release("mine")


def test_exists(build: Build, holder: HolderProcess,
                pty_children: Callable[..., PtyChild]) -> None:
    first, second = counter_child(pty_children), counter_child(pty_children)
    holder.client().hand_off("taken", first.master, child_pid=first.pid)
    run = run_c(build, holder.socket, "hand-off", "taken", str(second.master),
                pass_fds=(second.master,))
    expect_error(run, "exists", "taken")


def test_not_a_terminal(build: Build, holder: HolderProcess) -> None:
    r, w = os.pipe()
    try:
        run = run_c(build, holder.socket, "hand-off", "a-pipe", str(r), pass_fds=(r,))
    finally:
        os.close(r)
        os.close(w)
    expect_error(run, "not_a_terminal", "a-pipe")


def test_limit(build: Build, make_holder: Callable[..., HolderProcess],
               pty_children: Callable[..., PtyChild]) -> None:
    holder = make_holder("--max-sessions", "1")
    first, second = counter_child(pty_children), counter_child(pty_children)
    holder.client().hand_off("one", first.master, child_pid=first.pid)
    run = run_c(build, holder.socket, "hand-off", "two", str(second.master),
                pass_fds=(second.master,))
    expect_error(run, "limit", "two")


def test_a_bad_name_is_a_bad_request_with_no_id(build: Build, holder: HolderProcess) -> None:
    run = run_c(build, holder.socket, "release", "not a name")
    assert expect_error(run, "bad_request")["id"] is None


def test_a_stopped_holder_costs_one_deadline(build: Build, holder: HolderProcess) -> None:
    """A SIGSTOPped holder accepts (the kernel does) but never answers: the call ends at its
    deadline with `unresponsive`, not later and not hung."""
    os.kill(holder.pid, signal.SIGSTOP)
    try:
        run = run_c(build, holder.socket, "status", timeout=1.0)
    finally:
        os.kill(holder.pid, signal.SIGCONT)
    expect_error(run, "unresponsive")
    assert 0.9 < run.seconds < 3.0, run.seconds


# --- the client's own refusals ------------------------------------------------------------------


def test_the_timeout_invariant(build: Build, holder: HolderProcess) -> None:
    run = run_c(build, holder.socket, "retrieve", "anything", timeout=2.0)
    error = expect_error(run, "config")
    assert "drain_stop_budget + send_deadline = 4s" in error["message"]


def test_a_socket_path_over_103_bytes(build: Build, tmp_path: Path) -> None:
    path = "/tmp/" + "d" * 94 + "/s.sock"  # 106 bytes
    error = expect_error(run_c(build, path, "status"), "config")
    assert "103-byte limit" in error["message"] and path in error["message"]


def test_nothing_listening(build: Build, socket_dir: Path) -> None:
    expect_error(run_c(build, str(socket_dir / "none.sock"), "status"), "unavailable")
    expect_error(run_c(build, str(socket_dir / "no-dir" / "none.sock"), "status"), "unavailable")


def _connections(holder: HolderProcess) -> int:
    return holder.client().status().counters["connections"]


def test_a_socket_directory_open_to_others_is_refused_before_connecting(
    build: Build, holder: HolderProcess
) -> None:
    directory = os.path.dirname(holder.socket)
    before = _connections(holder)
    os.chmod(directory, 0o777)
    try:
        run = run_c(build, holder.socket, "status")
    finally:
        os.chmod(directory, 0o700)
    error = expect_error(run, "forbidden")
    assert f"socket directory {directory} has mode 0777" in error["message"]
    assert "nothing was sent" in error["message"]
    assert _connections(holder) == before + 1, "only our own status call reached the holder"


def test_a_symlinked_socket_directory_is_refused(build: Build, holder: HolderProcess,
                                                 socket_dir: Path) -> None:
    link = socket_dir / "link"
    link.symlink_to(os.path.dirname(holder.socket))
    error = expect_error(run_c(build, str(link / "escrowd.sock"), "status"), "forbidden")
    assert f"socket directory {link} is a symlink" in error["message"]


def test_a_socket_directory_of_another_uid_is_refused(build: Build, holder: HolderProcess) -> None:
    require_real("root", os.getuid() == 0,
                 "needs root to chown a directory to another uid (CI runs as root)")
    directory = os.path.dirname(holder.socket)
    os.chown(directory, NOBODY, NOBODY)
    try:
        run = run_c(build, holder.socket, "status")
    finally:
        os.chown(directory, 0, 0)
    error = expect_error(run, "forbidden")
    assert f"is owned by uid {NOBODY}; expected uid 0 (yours)" in error["message"]


def test_a_listener_of_another_uid_gets_nothing(build: Build, socket_dir: Path) -> None:
    """The directory is ours and private, but the process listening in it runs as another
    user: the client checks the peer's uid after connect and sends not a byte."""
    require_real("root", os.getuid() == 0,
                 "needs root: a forked listener drops to uid 65534 (CI runs as root)")
    path = str(socket_dir / "impostor.sock")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the impostor: never returns into pytest
        code = 1
        try:
            os.close(r)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(path)  # as root, in our private directory
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            s.listen(1)  # the peer credentials a client sees are taken here
            os.write(w, b"L")
            s.settimeout(20)
            conn, _ = s.accept()
            got = b""
            while chunk := conn.recv(4096):
                got += chunk
            os.write(w, str(len(got)).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    try:
        assert os.read(r, 1) == b"L"
        run = run_c(build, path, "status")
        received = b""
        while chunk := os.read(r, 64):
            received += chunk
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    error = expect_error(run, "forbidden")
    assert f"runs as uid {NOBODY}; expected uid 0 (yours)" in error["message"]
    assert received == b"0", "the impostor received nothing"


# --- a scripted fake holder, for what a real holder will not do on cue --------------------------

Handler = Callable[[socket.socket], None]


class FakeHolder:
    """A listening socket in a private directory; each accepted connection is served, in a
    thread, by the next handler of the script."""

    def __init__(self, directory: Path, script: list[Handler]) -> None:
        self.path = str(directory / "fake.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        self.listener.listen(8)
        self.listener.settimeout(20)
        self.failures: list[BaseException] = []
        self.thread = threading.Thread(target=self._serve, args=(script,), daemon=True)
        self.thread.start()

    def _serve(self, script: list[Handler]) -> None:
        for handler in script:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            try:
                handler(conn)
            except BaseException as exc:
                self.failures.append(exc)
            finally:
                conn.close()

    def close(self) -> None:
        self.thread.join(20)
        self.listener.close()
        assert not self.failures, self.failures


@pytest.fixture
def fake(socket_dir: Path) -> Iterator[Callable[[list[Handler]], FakeHolder]]:
    fakes: list[FakeHolder] = []

    def make(script: list[Handler]) -> FakeHolder:
        fakes.append(FakeHolder(socket_dir, script))
        return fakes[-1]

    yield make
    for f in fakes:
        f.close()


def read(conn: socket.socket) -> protocol.Request:
    conn.settimeout(10)
    body, fds = fdpass.recv_frame(conn, protocol.MAX_REQUEST_BYTES)
    fdpass.close_fds(fds)
    return protocol.decode_request(body)


def send(conn: socket.socket, message: protocol.Message,
         fd: int | Sequence[int] | None = None) -> None:
    fdpass.send_frame(conn, protocol.encode(message), fd)


WELCOME = protocol.Welcome(version=1, holder_version="fake", pid=1, drain_stop_budget=0.1,
                           send_deadline=0.1, ack_deadline=1.0)


def greet(conn: socket.socket) -> None:
    assert isinstance(read(conn), protocol.Hello)
    send(conn, WELCOME)


def test_a_holder_that_refuses_us_is_heard(build: Build, fake: Callable[..., FakeHolder]) -> None:
    """`forbidden` sent before hello, then a hang-up: reported as forbidden, with the
    holder's words, whether our hello went out before the hang-up or failed on it."""
    def refuse(conn: socket.socket) -> None:
        send(conn, protocol.Error(code="forbidden", message="peer uid differs from the holder's"))

    holder = fake([refuse])
    error = expect_error(run_c(build, holder.path, "status"), "forbidden")
    assert error["message"] == "peer uid differs from the holder's"


def test_unsupported_version_names_the_versions(build: Build,
                                                fake: Callable[..., FakeHolder]) -> None:
    def refuse(conn: socket.socket) -> None:
        hello = read(conn)
        assert isinstance(hello, protocol.Hello)
        assert (hello.version, hello.owner, hello.timeout) == (1, OWNER, 5.0)
        assert hello.client.startswith("escrow.c pid=")
        send(conn, protocol.Error(code="unsupported_version", message="speaks 2, 3",
                                  versions=[2, 3]))

    holder = fake([refuse])
    error = expect_error(run_c(build, holder.path, "status"), "unsupported_version")
    assert error["versions"] == [2, 3]


@pytest.mark.parametrize("answer", [
    b"\x00\x00\x00\x05hello",  # not MessagePack
    b"\x00\x00\x00\x00",  # an empty frame
    b"\xff\xff\xff\xff",  # 4 GiB
    protocol.encode(protocol.Done(id="x")),  # the wrong message
    protocol.HEADER.pack(10) + b"\x81\xa4type",  # cut short, then a hang-up
    hostile.frame(hostile.mp({"type": "gimme"})),  # an unknown type
    hostile.frame(hostile.mp({"type": "welcome", "version": 1})),  # required fields missing
    hostile.frame(hostile.mp([1, 2])),  # not a map
    b"\x00",  # a header cut short
])
def test_garbage_from_the_holder_is_a_protocol_error(
    build: Build, fake: Callable[..., FakeHolder], answer: bytes
) -> None:
    def garbage(conn: socket.socket) -> None:
        read(conn)
        conn.sendall(answer)

    holder = fake([garbage])
    expect_error(run_c(build, holder.path, "status"), "protocol")


def test_a_welcome_with_an_fd_is_refused(build: Build, fake: Callable[..., FakeHolder]) -> None:
    def with_fd(conn: socket.socket) -> None:
        read(conn)
        r, w = os.pipe()
        try:
            send(conn, WELCOME, fd=r)
        finally:
            os.close(r)
            os.close(w)

    holder = fake([with_fd])
    error = expect_error(run_c(build, holder.path, "status"), "protocol")
    assert "a welcome frame came with 1 fds, not 0" in error["message"]


def _hand_over(master: int, after_ack: Callable[[], None] = lambda: None) -> Handler:
    """A connection that hands `master` over, reads the ack, and hangs up without `done`."""

    def serve(conn: socket.socket) -> None:
        greet(conn)
        request = read(conn)
        assert isinstance(request, protocol.Retrieve)
        assert (request.keep, request.journal) == (False, False), "a plain retrieve"
        info = protocol.SessionInfo(owner=OWNER, id=request.id, state="draining",
                                    deposited_at=1.5, handoff_id="h-1")
        send(conn, protocol.Handoff(handoff_id="h-1", session=info, replay=b"R\r\n"), fd=master)
        assert read(conn) == protocol.Ack(id=request.id, handoff_id="h-1")
        after_ack()

    return serve


def _list_says(state: str, handoff_id: str | None, deposited_at: float = 1.5) -> Handler:
    def serve(conn: socket.socket) -> None:
        greet(conn)
        assert read(conn) == protocol.List(all_owners=False)
        info = protocol.SessionInfo(owner=OWNER, id="s", state=state,  # type: ignore[arg-type]
                                    deposited_at=deposited_at, handoff_id=handoff_id)
        send(conn, protocol.Sessions(sessions=[info]))

    return serve


@pytest.mark.parametrize(("state", "handoff_id", "deposited_at", "code", "confirmed"), [
    ("handed_off", "h-1", 1.5, None, True),  # the holder got our ack: ours, confirmed
    ("handed_off", "h-other", 1.5, "handed_off", None),  # someone else's since
    ("draining", None, 1.5, "unresponsive", None),  # the holder kept it: give our copy up
    ("draining", None, 9.5, None, False),  # a new deposit reused the id: ours, unconfirmed
    ("released", None, 1.5, None, False),  # the holder has no copy left
])
def test_a_missing_done_is_resolved_by_asking_list(
    build: Build, fake: Callable[..., FakeHolder], pty_children: Callable[..., PtyChild],
    state: str, handoff_id: str | None, deposited_at: float, code: str | None,
    confirmed: bool | None,
) -> None:
    """docs/design.md §4, step 8: after the ack, no `done`; the client keeps the fd unread
    and asks on a fresh connection who owns it."""
    child = pty_children(["sh", "-c", "echo live; sleep 30"])
    holder = fake([_hand_over(child.master), _list_says(state, handoff_id, deposited_at)])
    run = run_c(build, holder.path, "retrieve", "s")
    if code is not None:
        expect_error(run, code, "s")
        assert run.out == b"", "a copy given back was never read"
        return
    assert run.status == 0, run.err
    assert run.lines()[0]["confirmed"] is confirmed
    assert run.out == b"R\r\n"


def test_no_answer_and_no_holder_left_means_the_fd_is_ours(
    build: Build, fake: Callable[..., FakeHolder], socket_dir: Path,
    pty_children: Callable[..., PtyChild],
) -> None:
    """No `done`, and by the time the client asks again nothing listens: the holder is
    gone and took its copy with it. The fd is the app's, unconfirmed."""
    child = pty_children(["sh", "-c", "sleep 30"])
    path = socket_dir / "fake.sock"
    holder = fake([_hand_over(child.master, after_ack=path.unlink)])
    run = run_c(build, holder.path, "retrieve", "s")
    assert run.status == 0, run.err
    assert run.lines()[0]["confirmed"] is False


def test_ack_late_gives_the_copy_back(
    build: Build, fake: Callable[..., FakeHolder], pty_children: Callable[..., PtyChild]
) -> None:
    child = pty_children(["sh", "-c", "sleep 30"])

    def late(conn: socket.socket) -> None:
        greet(conn)
        read(conn)
        info = protocol.SessionInfo(owner=OWNER, id="s", state="draining", handoff_id="h-1")
        send(conn, protocol.Handoff(handoff_id="h-1", session=info, replay=b""), fd=child.master)
        assert isinstance(read(conn), protocol.Ack)
        send(conn, protocol.Error(code="ack_late", message="too late", id="s"))

    holder = fake([late])
    expect_error(run_c(build, holder.path, "retrieve", "s"), "ack_late", "s")


def test_a_non_terminal_handed_off_is_not_acked(
    build: Build, fake: Callable[..., FakeHolder]
) -> None:
    def pipe_instead(conn: socket.socket) -> None:
        greet(conn)
        read(conn)
        r, w = os.pipe()
        try:
            info = protocol.SessionInfo(owner=OWNER, id="s", state="draining")
            send(conn, protocol.Handoff(handoff_id="h", session=info, replay=b""), fd=r)
        finally:
            os.close(r)
            os.close(w)
        conn.settimeout(10)
        assert conn.recv(1) == b"", "no ack: the client hung up"

    holder = fake([pipe_instead])
    expect_error(run_c(build, holder.path, "retrieve", "s"), "protocol", "s")


JOURNAL = protocol.Journal(capacity=1 << 20, total=5, position=5)


@pytest.mark.parametrize(("journal", "fds", "refused"), [
    (True, 1, None),  # a journal file with its journal: closed, the deposit stands
    (True, 0, "a deposited frame came with 0 fds, not 1"),  # a journal without its file
    (False, 1, "a deposited frame came with 1 fds, not 0"),  # a file without a journal
])
def test_a_deposited_counts_its_journal_file_from_its_journal(
    build: Build, fake: Callable[..., FakeHolder], journal: bool, fds: int,
    refused: str | None,
) -> None:
    """The C client asks for no journal, but counts a deposited's fds from the message
    (PROTOCOL.md section 4). A journal file that comes with a journal (a holder resuming a
    session that journals, 10.4) is closed: the C API never writes one. A count that
    disagrees with `journal` is a bad frame, every fd of it closed (the driver fails on an
    fd left open): no answer to believe, so the hand-off keeps the session in doubt and
    its end of custody is confirmed by the holder's list, as every end that held one is."""
    def answer(conn: socket.socket) -> None:
        greet(conn)
        request = read(conn)
        assert isinstance(request, protocol.Deposit) and request.journal is False
        r, w = os.pipe()  # the "journal file"
        try:
            send(conn, protocol.Deposited(id=request.id, journal=JOURNAL if journal else None),
                 fd=[r][:fds])
        finally:
            os.close(r)
            os.close(w)
        conn.settimeout(10)
        assert conn.recv(1) == b"", "custody ends: the client hangs up"

    holder = fake([answer, _list_says("draining", None)])
    master, other = os.pipe()  # what the client deposits: the fake does not look
    try:
        run = run_c(build, holder.path, "hand-off", "s", str(master), pass_fds=(master,))
    finally:
        os.close(master)
        os.close(other)
    if refused is None:
        assert run.status == 0, run.err
        return
    # The bad frame is not believed; the list shows the session draining: handed off.
    assert run.status == 0, run.err


@pytest.mark.parametrize(("journal", "fds", "refused"), [
    (True, 2, None),  # the master, then the journal file: the file is closed, the master kept
    (True, 1, "a handoff frame came with 1 fds, not 2"),  # a journal without its file
    (False, 2, "a handoff frame came with 2 fds, not 1"),  # a second fd without a journal
])
def test_a_handoff_counts_its_journal_file_from_its_journal(
    build: Build, fake: Callable[..., FakeHolder], pty_children: Callable[..., PtyChild],
    journal: bool, fds: int, refused: str | None,
) -> None:
    """A handoff carries the master, and a journal file after it when `journal` is set
    (PROTOCOL.md sections 4 and 12.6). The C retrieve asks for neither keep nor journal, so
    it closes a journal file that comes anyway and acks the master; a count that disagrees
    with `journal` is a bad frame, never acked."""
    child = pty_children(["sh", "-c", "sleep 30"])

    def serve(conn: socket.socket) -> None:
        greet(conn)
        assert read(conn) == protocol.Retrieve(id="s")
        info = protocol.SessionInfo(owner=OWNER, id="s", state="draining", handoff_id="h-1",
                                    buffered_bytes=3)
        r, w = os.pipe()  # the "journal file"
        try:
            send(conn, protocol.Handoff(handoff_id="h-1", session=info, replay=b"R\r\n",
                                        replay_journaled=2, journal=JOURNAL if journal else None),
                 fd=[child.master, r][:fds])
        finally:
            os.close(r)
            os.close(w)
        if refused is not None:
            conn.settimeout(10)
            assert conn.recv(1) == b"", "no ack: the client hung up"
            return
        assert read(conn) == protocol.Ack(id="s", handoff_id="h-1", keep=False)
        send(conn, protocol.Done(id="s"))

    holder = fake([serve])
    run = run_c(build, holder.path, "retrieve", "s")
    if refused is not None:
        assert expect_error(run, "protocol", "s")["message"] == refused
        assert run.out == b""
        return
    assert run.status == 0, run.err
    (facts,) = run.lines()
    assert (facts["confirmed"], facts["replay_journaled"], facts["replay_trimmed"]) == (
        True, 2, 0)
    assert run.out == b"R\r\n"


def test_the_sanitizers_are_built_in(build: Build) -> None:
    """A clean sanitized run means something only if the sanitizers are really there."""
    nm = subprocess.run(["nm", str(build.sanitized)], capture_output=True, text=True)
    assert "__asan_init" in nm.stdout and "__ubsan_handle" in nm.stdout
    usage = subprocess.run([str(build.sanitized)], capture_output=True,
                           env={**os.environ, **SANITIZER_ENV})
    assert usage.returncode == 2 and b"usage" in usage.stderr


# --- the codec against the protocol's test vectors -----------------------------------------------

VECTORS = load_vectors()
# SessionInfo fields the C client does not speak: it skips them, as PROTOCOL.md section 3.1
# lets a decoder (only a program the holder started, `start`, which C does not ask, has them).
UNSPOKEN_SESSION_FIELDS = ("started", "exit_status")


def spoken(value: Any) -> Any:
    """`value` (a decoded message, as JSON) without the fields the C client does not speak."""
    if isinstance(value, list):
        return [spoken(v) for v in value]
    if not isinstance(value, dict):
        return value
    session = "owner" in value and "state" in value
    return {k: spoken(v) for k, v in value.items()
            if not (session and k in UNSPOKEN_SESSION_FIELDS)}
# The vectors of what the C client (and the Node package, over its codec) does not speak:
# it neither starts programs nor waits for them (PROTOCOL.md 12.9, 12.10), and a `waited`
# never comes to it; every other vector it encodes or decodes.
NOT_SPOKEN = frozenset({"start", "wait", "waited"})
REQUEST_VECTORS = [n for n, v in VECTORS.items()
                   if v["direction"] == "client_to_holder" and n not in NOT_SPOKEN]
RESPONSE_VECTORS = [n for n, v in VECTORS.items()
                    if v["direction"] == "holder_to_client" and n not in NOT_SPOKEN]


def _flag(value: bool) -> str:
    assert isinstance(value, bool)
    return "true" if value else "false"


def _pairs(mapping: dict[str, str]) -> list[str]:
    return [f"{k}={v}" for k, v in mapping.items()]


def encode_args(message: dict[str, Any]) -> list[str]:
    """The driver's `encode` arguments for a request vector's message: every field of it,
    so the bytes the C encoder writes are compared with the vector's, none left to a
    default of the driver's."""
    kind = message["type"]
    if kind == "hello":
        assert message["version"] == 1
        return [kind, message["owner"], message["client"], repr(message["timeout"])]
    if kind == "deposit":
        return [kind, message["id"], message["label"], str(message["child_pid"] or 0),
                str(message["cols"]), str(message["rows"]), _flag(message["journal"]),
                *_pairs(message["meta"])]
    if kind == "retrieve":
        return [kind, message["id"], _flag(message["keep"]), _flag(message["journal"]),
                _flag(message["replay_file"])]
    if kind == "retrieve_many":
        return [kind, _flag(message["keep"]), _flag(message["journal"]),
                _flag(message["replay_file"]), *message["ids"]]
    if kind == "ack":
        return [kind, message["id"], message["handoff_id"], _flag(message["keep"])]
    if kind == "ack_many":
        return [kind, _flag(message["keep"]), *_pairs(message["acks"])]
    if kind == "update":
        dims = ["-" if message[d] is None else str(message[d]) for d in ("cols", "rows")]
        meta = message["meta"]
        return [kind, message["id"], *dims,
                *([] if meta is None else _pairs(meta) if meta else ["{}"])]
    if kind == "list":
        return [kind, _flag(message["all_owners"])]
    if kind == "status":
        return [kind]
    if kind == "release":
        return [kind, message["id"]]
    raise AssertionError(f"the driver cannot encode a {kind} yet: teach encode_args and "
                         "escrow-c.c's cmd_encode")


@pytest.mark.parametrize("name", REQUEST_VECTORS)
def test_the_c_encoder_writes_each_request_vector(build: Build, name: str) -> None:
    run = run_c(build, None, "encode", *encode_args(VECTORS[name]["message"]))
    assert run.status == 0, run.err
    assert run.out.decode().strip() == VECTORS[name]["frame"]


@pytest.mark.parametrize("name", RESPONSE_VECTORS)
def test_the_c_decoder_reads_each_response_vector(build: Build, name: str) -> None:
    """Every field as the vector has it, and the fds the C receive path would insist on
    (PROTOCOL.md section 4: a handoff or deposited with a journal carries one more)."""
    run = run_c(build, None, "decode", VECTORS[name]["frame"])
    decoded = run.json()
    decoded.pop("escrow_code", None)  # the driver's own additions to an error
    decoded.pop("sys_errno", None)
    assert decoded == spoken(VECTORS[name]["message"])
    assert run.lines() == [{"fds": VECTORS[name]["fds"]}]


def test_every_vector_is_spoken_or_listed_as_not() -> None:
    assert NOT_SPOKEN <= set(VECTORS)
    assert set(REQUEST_VECTORS) | set(RESPONSE_VECTORS) | NOT_SPOKEN == set(VECTORS)


def test_every_request_type_and_response_type_has_a_vector() -> None:
    types = {v["message"]["type"] for v in VECTORS.values()}
    needed = {"hello", "deposit", "retrieve", "retrieve_many", "update", "ack", "ack_many",
              "list", "welcome", "deposited", "handoff", "done", "done_many", "updated",
              "sessions", "error"}
    assert needed <= types
    journals = {v["message"]["type"] for v in VECTORS.values()
                if v["message"].get("journal") not in (None, False)}
    assert {"deposit", "deposited", "handoff"} <= journals, "a vector with a journal each"


@pytest.mark.skipif(not (os.uname().sysname == "Linux" and os.uname().machine in (
    "x86_64", "aarch64")), reason="the layout shown is 64-bit Linux's")
def test_the_c_macros_build_the_documented_control_message(build: Build) -> None:
    """PROTOCOL.md 4.4's byte listing (for ports without CMSG_* macros) is what the C
    macros build, and section 13's Linux constants are the C headers'."""
    layout = run_c(build, None, "cmsg").json()
    blocks = dict(doc_blocks(doc_text(), "cmsg"))
    assert bytes.fromhex(layout["bytes"]) == hex_bytes(blocks["linux-64"])
    # A handoff with a journal: the master (7), then the journal file (9), in one message.
    assert bytes.fromhex(layout["bytes_two"]) == hex_bytes(blocks["linux-64-two"])
    assert (layout["cmsg_len_4"], layout["cmsg_space_4"], layout["cmsg_space_32"]) == (
        20, 24, 48)
    assert (layout["cmsg_len_8"], layout["cmsg_space_8"]) == (24, 24)
    assert layout["header"] == layout["data_offset"] == 16
    constants = linux_constants()
    for name in ("SOL_SOCKET", "SCM_RIGHTS", "MSG_CTRUNC", "MSG_NOSIGNAL", "MSG_CMSG_CLOEXEC",
                 "sun_path"):
        assert constants[name] == layout[name.lower()], name
