"""The Node package (client/node/) against a real holder, and its codec against the vectors.

The package is built here as a user builds it from a clone: `npm ci` where node_modules is
missing or older than package-lock.json, then `npm run build` (the addon with the system C
compiler, warnings as errors, then `tsc` in strict mode). Each test runs a small Node
program over the built package (`require('client/node')`), whose JSON lines on stdout say
what it did, against a real escrowd on a temporary socket, with real PTYs and real children;
where a holder must die, it is SIGKILLed under its keeper.

Without node, npm or cc the tests are skipped here and fail on CI (`CI=true`);
scripts/setup --test installs them. Every part of the C client is built in: none is left out.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fakeholder import FakeHolder, Peer
from hostile import COUNTER, assert_gap_free_from_1, read_more_lines
from test_c_client import REQUEST_VECTORS, VECTORS, encode_args
from test_docs import block_with, commands
from test_survive import kill_serving_holder

from conftest import OWNER, HolderProcess, PtyChild, fd_count, require_program, wait_for
from escrow_client import protocol

PACKAGE = Path(__file__).resolve().parent.parent / "client" / "node"


def _stale(package: Path) -> bool:
    modules = package / "node_modules"
    lock = package / "package-lock.json"
    return not modules.is_dir() or modules.stat().st_mtime < lock.stat().st_mtime


def build_package(package: Path = PACKAGE) -> None:
    """npm ci where needed, then npm run build; any compiler warning fails it."""
    npm = require_program("npm")
    require_program("node")
    require_program("cc")
    if _stale(package):
        result = subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=package,
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout + result.stderr
    result = subprocess.run([npm, "run", "--silent", "build"], cwd=package,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    warnings = [line for line in result.stderr.splitlines() if not line.startswith("cc ")]
    assert not warnings, "\n".join(warnings)


@pytest.fixture(scope="module")
def package() -> Path:
    build_package()
    return PACKAGE


class NodeApp:
    """A Node program over the package: JSON lines out, lines in."""

    def __init__(self, package: Path, script: str, socket: str,
                 pass_fds: tuple[int, ...] = (), prefix: tuple[str, ...] = ()) -> None:
        prelude = (f"const escrow = require({str(package)!r});\n"
                   f"const client = new escrow.EscrowClient({{owner: {OWNER!r}, "
                   f"socket: {socket!r}}});\n"
                   "const say = (o) => process.stdout.write(JSON.stringify(o) + '\\n');\n"
                   "const lines = require('node:readline').createInterface({input: "
                   "process.stdin});\n"
                   "const next = () => new Promise((r) => lines.once('line', r));\n"
                   "const fail = (e) => { say({error: e.code || String(e), id: e.id, "
                   "errno: e.errno, message: e.message}); process.exit(1); };\n")
        program = prelude + f"(async () => {{ {script} }})().then(() => process.exit(0), fail);"
        self.proc = subprocess.Popen([*prefix, "node", "-e", program],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, pass_fds=pass_fds)
        self.buffer = b""

    def next(self, what: str, timeout: float = 10.0) -> dict[str, Any]:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.proc.stdout], [], [], max(left, 0))
            if not ready:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}")
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                assert self.proc.stderr is not None
                raise AssertionError(f"node exited ({self.proc.wait()}) before {what}: "
                                     f"{self.proc.stderr.read().decode(errors='replace')}")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        message: dict[str, Any] = json.loads(line)
        return message

    def send(self, line: str = "") -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def wait(self, timeout: float = 15.0) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()


@pytest.fixture
def node_apps() -> Iterator[Callable[..., NodeApp]]:
    started: list[NodeApp] = []

    def start(*args: Any, **kwargs: Any) -> NodeApp:
        app = NodeApp(*args, **kwargs)
        started.append(app)
        return app

    yield start
    for app in started:
        app.kill()


def run_node(package: Path, socket: str, script: str) -> dict[str, Any]:
    """A program that says one JSON line and exits 0."""
    app = NodeApp(package, script, socket)
    try:
        line = app.next("its answer")
        assert app.wait() == 0, line
        return line
    finally:
        app.kill()


def counter(pty_children: Callable[..., PtyChild]) -> PtyChild:
    return pty_children(["sh", "-c", COUNTER])


def state_of(holder: HolderProcess, sid: str) -> str | None:
    return next((s.state for s in holder.client().list() if s.id == sid), None)


# --- the codec against the protocol's test vectors -----------------------------------------------


def test_the_package_encodes_each_request_vector_byte_for_byte(package: Path) -> None:
    """The addon sends with the C encoder: every request vector, through `_codec.encode` with
    the arguments the C driver's `encode` takes, gives the vector's frame."""
    calls = {name: ["encode", *encode_args(VECTORS[name]["message"])][1:]
             for name in REQUEST_VECTORS}
    script = (f"const {{_codec}} = require({str(package)!r});\n"
              f"const calls = {json.dumps(calls)};\n"
              "const out = {};\n"
              "for (const [name, args] of Object.entries(calls)) "
              "out[name] = _codec.encode(args[0], args.slice(1));\n"
              "process.stdout.write(JSON.stringify(out));")
    result = subprocess.run(["node", "-e", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout)
    assert set(got) == set(REQUEST_VECTORS) and len(got) >= 10
    for name in REQUEST_VECTORS:
        assert got[name] == VECTORS[name]["frame"], name


# --- the calls against a real holder -------------------------------------------------------------


def test_status_list_and_welcome_agree_with_python(package: Path, holder: HolderProcess) -> None:
    said = run_node(package, holder.socket,
                    "say({status: await client.status(), welcome: await client.welcome(), "
                    "list: await client.list({allOwners: true})});")
    status = holder.client().status()
    assert said["status"]["pid"] == status.pid and said["status"]["version"] == status.version
    assert said["status"]["socket"] == status.socket
    assert said["welcome"]["drainStopBudget"] == 3.0
    assert said["list"] == []


def test_a_deposit_under_custody_is_held_then_python_retrieves_every_line(
    package: Path, holder: HolderProcess, pty_children: Callable[..., PtyChild],
    node_apps: Callable[..., NodeApp],
) -> None:
    """The Node app deposits a live terminal into a custody and reads it ('data'); while it
    does, the session is held by the app's pid; once the custody closes it drains, and a
    retrieve from Python gets every line from L1 on, none twice."""
    child = counter(pty_children)
    app = node_apps(package, f"""
        const custody = await client.openCustody();
        await custody.deposit('tab', {child.master}, {{childPid: {child.pid}, label: 'sh',
                                                       meta: {{cwd: '/tmp'}}}});
        let seen = Buffer.alloc(0);
        custody.on('data', (id, data) => {{ seen = Buffer.concat([seen, data]); }});
        custody.startReading('tab');
        say({{deposited: custody.protected, pid: process.pid}});
        await next();
        await custody.close();
        say({{closed: true, seen: seen.toString('latin1')}});
    """, holder.socket, pass_fds=(child.master,))
    said = app.next("the deposit")
    assert said["deposited"] is True
    info = next(s for s in holder.client().list() if s.id == "tab")
    assert info.state == "held" and info.custodian_pid == said["pid"]
    assert info.meta == {"cwd": "/tmp"} and info.child_pid == child.pid
    app.send()
    seen = app.next("custody closed")["seen"].encode("latin1")
    assert app.wait() == 0
    wait_for(lambda: state_of(holder, "tab") == "draining", 5.0, "draining")
    got = holder.client().retrieve("tab")
    try:
        whole = seen + got.replay
        assert_gap_free_from_1(read_more_lines(got.fd, whole, 3))
    finally:
        os.close(got.fd)


def test_node_hands_off_and_retrieves_the_session_itself(
    package: Path, holder: HolderProcess, pty_children: Callable[..., PtyChild],
) -> None:
    """A hand-off, then a retrieve from another Node process: the replay starts at L1, the fd
    it gets is a live terminal, and the holder forgets the session (handed_off)."""
    child = counter(pty_children)
    app = NodeApp(package, f"await client.handOff('tab', {child.master}, "
                  f"{{childPid: {child.pid}}}); say({{handedOff: true}});",
                  holder.socket, pass_fds=(child.master,))
    try:
        assert app.next("the hand-off") == {"handedOff": True}
        assert app.wait() == 0
    finally:
        app.kill()
    os.close(child.master)
    child.master = os.open("/dev/null", os.O_RDONLY)  # the fixture closes it
    wait_for(lambda: state_of(holder, "tab") == "draining", 5.0, "draining")
    said = run_node(package, holder.socket, """
        const got = await client.retrieve('tab');
        const fs = require('node:fs');
        const more = Buffer.alloc(4096);
        const n = fs.readSync(got.fd, more);
        say({confirmed: got.confirmed, replay: got.replay.toString('latin1'),
             more: more.subarray(0, n).toString('latin1'), tty: require('node:tty').isatty(got.fd),
             state: got.session.state});
        fs.closeSync(got.fd);""")
    assert said["confirmed"] is True and said["tty"] is True and said["state"] == "draining"
    assert said["replay"].startswith("L1\r\n")
    assert_gap_free_from_1((said["replay"] + said["more"]).encode("latin1").rsplit(b"\n", 1)[0])
    assert state_of(holder, "tab") == "handed_off"


def test_errors_carry_the_code_the_id_and_errno(package: Path, holder: HolderProcess,
                                                socket_dir: Path) -> None:
    said = run_node(package, holder.socket, """
        const codes = [];
        for (const call of [() => client.retrieve('nope'), () => client.release('nope')]) {
          try { await call(); codes.push('none'); }
          catch (e) { codes.push([e instanceof Error, e.code, e.id, e.errno, e.message]); }
        }
        say({codes});""")
    for is_error, code, sid, errno, message in said["codes"]:
        assert is_error is True and code == "unknown" and sid == "nope" and errno == 0
        assert "nope" in message
    nothing = str(socket_dir / "none" / "escrowd.sock")
    os.mkdir(socket_dir / "none", 0o700)
    said = run_node(package, nothing, """
        try { await client.status(); say({code: 'none'}); }
        catch (e) { say({code: e.code, errno: e.errno}); }""")
    assert said["code"] == "unavailable" and said["errno"] != 0
    result = subprocess.run(["node", "-e", f"""
        const escrow = require({str(package)!r});
        try {{ new escrow.EscrowClient({{owner: 'x', socket: '/' + 'a'.repeat(200)}}); }}
        catch (e) {{ console.log(e.code); }}"""], capture_output=True, text=True)
    assert result.stdout.strip() == "config", result.stderr


# --- custody that survives the holder, and the launch of a Node terminal app --------------------


def test_a_custody_lapses_when_the_holder_dies_and_is_protected_again(
    package: Path, make_holder: Callable[..., HolderProcess],
    pty_children: Callable[..., PtyChild], node_apps: Callable[..., NodeApp],
) -> None:
    """Under a keeper, the serving holder is SIGKILLed: the custody emits 'lapsed', resumes
    by itself on the next holder ('protected'), and the session is held by the app again."""
    holder = make_holder(keeper=True)
    child = counter(pty_children)
    app = node_apps(package, f"""
        const custody = await client.openCustody();
        custody.on('lapsed', (e) => say({{event: 'lapsed', code: e.code,
                                          protected: custody.protected}}));
        custody.on('protected', () => say({{event: 'protected', protected: custody.protected}}));
        custody.on('data', () => {{}});
        await custody.deposit('tab', {child.master}, {{childPid: {child.pid}, journal: true}});
        custody.startReading('tab');
        say({{event: 'deposited', journaled: custody.journaled('tab'), pid: process.pid}});
        await new Promise(() => {{}});
    """, holder.socket, pass_fds=(child.master,))
    deposited = app.next("the deposit")
    assert deposited["journaled"] is True
    kill_serving_holder(holder)
    lapsed = app.next("'lapsed' once the holder died")
    assert lapsed == {"event": "lapsed", "code": "unavailable", "protected": False}
    assert app.next("'protected' on the next holder") == {"event": "protected", "protected": True}
    info = next(s for s in holder.client().list() if s.id == "tab")
    assert info.state == "held" and info.custodian_pid == deposited["pid"]


def test_a_reclaim_into_custody_takes_every_session_with_its_replay(
    package: Path, holder: HolderProcess, pty_children: Callable[..., PtyChild],
) -> None:
    """Two draining sessions: reclaimAll({journal}) retrieves both into one custody, each
    with its replay from L1 and a journal, and both are held by that custody afterwards."""
    for sid in ("one", "two"):
        child = counter(pty_children)
        holder.client().hand_off(sid, child.master, child_pid=child.pid)
        wait_for(lambda sid=sid: state_of(holder, sid) == "draining", 5.0, f"{sid} draining")
    app = NodeApp(package, """
        const custody = await client.openCustody();
        const report = await custody.reclaimAll({journal: true});
        say({ids: report.retrieved.map((r) => r.id).sort(), failed: report.failed,
             replays: report.retrieved.map((r) => r.replay.toString('latin1').slice(0, 4)),
             journals: report.retrieved.map((r) => custody.journaled(r.id)),
             instance: report.holderInstance, restarts: report.restarts});
        await next();
        await custody.close();""", holder.socket)
    try:
        said = app.next("the report")
        assert said["ids"] == ["one", "two"] and said["failed"] == {}
        assert said["replays"] == ["L1\r\n", "L1\r\n"] and said["journals"] == [True, True]
        assert said["instance"] == holder.client().status().instance
        assert said["restarts"] == 0
        assert {s.state for s in holder.client().list()} == {"held"}
        app.send()
        assert app.wait() == 0
    finally:
        app.kill()


def _term_app(package: Path, holder: HolderProcess, out: Path,
              *new: str) -> subprocess.Popen[bytes]:
    argv = ["node", str(package / "examples" / "term-app.js"), "--socket", holder.socket,
            "--owner", OWNER, "--out", str(out)]
    for sid in new:
        argv += ["--new", sid]
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL)


def _events(out: Path) -> list[dict[str, Any]]:
    path = out / "events"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_the_example_app_relaunched_after_sigkill_shows_its_session_from_l1(
    package: Path, holder: HolderProcess, tmp_path: Path, apps: list[subprocess.Popen[bytes]],
) -> None:
    """examples/term-app.js creates a session, is SIGKILLed, and is launched again: the second
    run reclaims the session into custody and its screen (replay, then live) starts at L1."""
    first = _term_app(package, holder, tmp_path, "tab")
    apps.append(first)  # type: ignore[arg-type]
    wait_for(lambda: any(e["event"] == "created" for e in _events(tmp_path)), 10.0, "created")
    created = next(e for e in _events(tmp_path) if e["event"] == "created")
    assert created["journal"] is True
    screen = tmp_path / f"tab.{first.pid}.out"
    wait_for(lambda: screen.exists() and screen.read_bytes().count(b"\n") >= 5, 10.0, "output")
    first.kill()
    first.wait()
    second = _term_app(package, holder, tmp_path, "tab")
    apps.append(second)  # type: ignore[arg-type]
    def reclaims() -> list[dict[str, Any]]:
        return [e for e in _events(tmp_path) if e["event"] == "reclaimed"]

    wait_for(lambda: len(reclaims()) == 2, 15.0, "the relaunch's reclaim")
    reclaimed = reclaims()[1]
    assert reclaimed["retrieved"] == ["tab"] and reclaimed["failed"] == {}
    again = tmp_path / f"tab.{second.pid}.out"
    wait_for(lambda: again.exists() and again.read_bytes().count(b"\n") >= 40, 10.0,
             "the second run's screen")
    assert again.read_bytes().startswith(b"L1\r\n")
    assert_gap_free_from_1(again.read_bytes().rsplit(b"\n", 1)[0])
    second.terminate()
    assert second.wait(10) == 0
    wait_for(lambda: state_of(holder, "tab") == "draining", 5.0, "draining after SIGTERM")


# --- the package's README ------------------------------------------------------------------------


def test_the_readme_builds_the_package_and_its_app_comes_back_from_sigkill_at_l1(
    package: Path, holder: HolderProcess, tmp_path: Path, apps: list[subprocess.Popen[bytes]],
) -> None:
    """client/node/README.md: its build command as written, then its launch program, run as a
    user runs it (`require('escrow-client')`, the holder at $ESCROW_SOCKET): the first run
    makes tab-1 and shows it; SIGKILLed and run again, it shows tab-1 from L1 on."""
    readme = PACKAGE / "README.md"
    [build] = commands(block_with("sh", readme, "npm ci"))
    result = subprocess.run(["bash", "-c", build.text], cwd=PACKAGE.parent.parent,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    program = tmp_path / "app.js"
    program.write_text(block_with("js", readme, "reclaimAll").text)
    modules = tmp_path / "node_modules"
    modules.mkdir()
    (modules / "escrow-client").symlink_to(PACKAGE)
    env = {**os.environ, "ESCROW_SOCKET": holder.socket}

    def run(screen: Path) -> subprocess.Popen[bytes]:
        with open(screen, "wb") as out:
            app = subprocess.Popen(["node", str(program)], cwd=tmp_path, env=env, stdout=out,
                                   stdin=subprocess.DEVNULL)
        apps.append(app)  # type: ignore[arg-type]
        return app

    first, second = tmp_path / "first.out", tmp_path / "second.out"
    app = run(first)
    wait_for(lambda: first.read_bytes().count(b"\n") >= 5, 10.0, "the new tab's lines")
    app.kill()
    app.wait()
    app = run(second)
    wait_for(lambda: second.read_bytes().count(b"\n") >= 40, 15.0, "the tab again")
    assert second.read_bytes().startswith(b"L1\r\n")
    assert_gap_free_from_1(second.read_bytes().rsplit(b"\n", 1)[0])
    assert [s.id for s in holder.client().list()] == ["tab-1"]
    app.terminate()
    assert app.wait(10) == 0


# --- fds, promises and reads under the custody -------------------------------------------------


def test_the_apps_fds_come_back_after_a_deposit_a_lapse_a_release_and_a_close(
    package: Path, make_holder: Callable[..., HolderProcess],
    pty_children: Callable[..., PtyChild], node_apps: Callable[..., NodeApp],
) -> None:
    """Counted in /proc/<pid>/fd of the Node app: a held session costs one kept duplicate
    beyond the custody's socket; a lapse and a resume on the keeper's next holder cost
    nothing; a release gives the duplicate back, and a close the socket: the count is the
    one before the custody."""
    holder = make_holder(keeper=True)
    child = counter(pty_children)
    app = node_apps(package, f"""
        await client.status();  // the thread pool and the loop's own fds, before counting
        say({{step: 'before'}}); await next();
        const custody = await client.openCustody();
        custody.on('data', () => {{}});
        custody.on('lapsed', () => say({{step: 'lapsed'}}));
        custody.on('protected', () => say({{step: 'protected'}}));
        say({{step: 'opened'}}); await next();
        await custody.deposit('tab', {child.master}, {{childPid: {child.pid}, journal: true}});
        custody.startReading('tab');
        say({{step: 'held'}}); await next();
        await custody.release('tab');
        say({{step: 'released'}}); await next();
        await custody.close();
        say({{step: 'closed'}}); await next();
    """, holder.socket, pass_fds=(child.master,))
    pid = app.proc.pid
    counts = {}
    for step in ("before", "opened", "held"):
        assert app.next(step) == {"step": step}
        counts[step] = fd_count(pid)
        if step != "held":
            app.send()
    kill_serving_holder(holder)
    assert app.next("'lapsed'") == {"step": "lapsed"}
    assert app.next("'protected'") == {"step": "protected"}
    wait_for(lambda: state_of(holder, "tab") == "held", 10.0, "tab held again")
    assert fd_count(pid) == counts["held"]
    app.send()
    for step in ("released", "closed"):
        assert app.next(step) == {"step": step}
        counts[step] = fd_count(pid)
        app.send()
    assert app.wait() == 0
    assert counts["opened"] == counts["before"] + 1, counts  # the custody's socket
    assert counts["held"] == counts["opened"] + 1, counts  # the kept duplicate
    assert counts["released"] == counts["opened"], counts
    assert counts["closed"] == counts["before"], counts


CALLS = ("status", "welcome", "list", "release", "update", "retrieve", "handOff", "reclaimAll",
         "deposit", "custodyUpdate", "custodyRetrieve", "custodyReclaim", "custodyRelease")


def test_every_promise_settles_while_the_holder_is_stopped_and_once_it_is_gone(
    package: Path, holder: HolderProcess, pty_children: Callable[..., PtyChild],
    node_apps: Callable[..., NodeApp],
) -> None:
    """With the holder SIGSTOPped, every call of the client and of a custody opened before
    rejects within the client's timeout (1 s here: nothing hangs), each with the C client's
    code; with the holder SIGKILLed, every call rejects at once: 'unavailable'."""
    child = counter(pty_children)
    script = """
        const c = new escrow.EscrowClient({owner: client.owner, socket: client.socket,
                                           timeout: 1});
        const settle = async (custody) => {
          const calls = {
            status: () => c.status(), welcome: () => c.welcome(), list: () => c.list(),
            release: () => c.release('x'), update: () => c.update('x', {cols: 80}),
            retrieve: () => c.retrieve('x'), handOff: () => c.handOff('x', MASTER, {}),
            reclaimAll: () => c.reclaimAll({deadline: 2}),
            deposit: () => custody.deposit('tab', MASTER, {}),
            custodyUpdate: () => custody.update('tab', {cols: 81}),
            custodyRetrieve: () => custody.retrieve('x'),
            custodyReclaim: () => custody.reclaimAll({deadline: 2}),
            custodyRelease: () => custody.release('tab'),
          };
          const names = Object.keys(calls);
          const settled = await Promise.allSettled(names.map((n) => calls[n]()));
          const out = {};
          names.forEach((n, i) => {
            out[n] = settled[i].status === 'fulfilled' ? 'ok' : settled[i].reason.code;
          });
          return out;
        };
        const custody = await c.openCustody();
        say({opened: true}); await next();
        say({stopped: await settle(custody)}); await next();
        say({gone: await settle(custody)});
        await custody.close();
    """.replace("MASTER", str(child.master))
    app = node_apps(package, script, holder.socket, pass_fds=(child.master,))
    assert app.next("the custody") == {"opened": True}
    os.kill(holder.pid, signal.SIGSTOP)
    try:
        app.send()
        stopped = app.next("every call settled with the holder stopped", timeout=120.0)
    finally:
        os.kill(holder.pid, signal.SIGCONT)
    assert len(stopped["stopped"]) == len(CALLS), stopped
    # A fresh connection's calls time out. A custody's first call, the deposit, gets no
    # answer (kept: 'indeterminate'), and its connection stays, owed that answer: what
    # follows on it is 'busy' (the answer still owed: nothing sent, nothing kept), or for a
    # reclaim into it 'config' (a 1 s timeout does not exceed this holder's
    # drain_stop_budget + send_deadline). Once the holder is gone, every call is refused as
    # a lapsed custody's: 'unavailable'.
    for name in ("status", "welcome", "list", "release", "update", "retrieve", "handOff"):
        assert stopped["stopped"][name] == "unresponsive", stopped
    assert stopped["stopped"]["deposit"] == "indeterminate", stopped
    for name in ("custodyUpdate", "custodyRetrieve", "custodyRelease"):
        assert stopped["stopped"][name] in {"busy", "unavailable"}, stopped
    assert set(stopped["stopped"].values()) <= {"unresponsive", "unavailable", "config",
                                                "indeterminate", "busy"}, stopped
    holder.proc.kill()
    holder.proc.wait()
    app.send()
    gone = app.next("every call settled with the holder gone", timeout=120.0)["gone"]
    assert len(gone) == len(CALLS), gone
    # The custody's deposit of 'tab' again: it holds 'tab' already (kept, in doubt), so the
    # C custody's answer as it came, never 'indeterminate' a second time.
    assert gone.pop("deposit") in {"exists", "unavailable"}, gone
    assert set(gone.values()) == {"unavailable"}, gone
    for name in ("status", "welcome", "list", "release", "update", "retrieve", "handOff",
                 "reclaimAll"):
        assert gone[name] == "unavailable", gone
    assert app.wait() == 0


def test_a_read_due_during_a_custody_call_is_done_once_the_call_is_over(
    package: Path, holder: HolderProcess, tmp_path: Path,
    pty_children: Callable[..., PtyChild], node_apps: Callable[..., NodeApp],
) -> None:
    """Reads pause while a custody call runs. The shell prints its one line while an update
    waits on a SIGSTOPped holder, then nothing more: once the holder answers and the call
    is over, the line is read ('data'), with no further output to wake the read."""
    go, printed = tmp_path / "go", tmp_path / "printed"
    child = pty_children(["sh", "-c", f'while [ ! -e "{go}" ]; do sleep 0.01; done; '
                          f'echo DUE; : > "{printed}"; exec sleep 60'])
    app = node_apps(package, f"""
        const custody = await client.openCustody();
        let seen = '';
        custody.on('data', (id, data) => {{
          seen += data.toString('latin1');
          if (seen.includes('DUE')) say({{read: seen}});
        }});
        await custody.deposit('tab', {child.master}, {{childPid: {child.pid}}});
        custody.startReading('tab');
        say({{held: true}}); await next();
        const update = custody.update('tab', {{cols: 100, rows: 30}});
        say({{calling: true}});
        await update;
        say({{updated: true}});
        await new Promise(() => {{}});
    """, holder.socket, pass_fds=(child.master,))
    assert app.next("the deposit") == {"held": True}
    os.kill(holder.pid, signal.SIGSTOP)
    try:
        app.send()
        assert app.next("the update started") == {"calling": True}
        go.touch()
        wait_for(printed.exists, 10.0, "the shell's line printed")
    finally:
        os.kill(holder.pid, signal.SIGCONT)
    assert app.next("the update") == {"updated": True}
    assert "DUE" in app.next("the line read after the call")["read"]


# --- what a custody holds, and whether it is protected, are the C custody's answers -------------


def _fake_holder(tmp_path: Path, scripts: list[Callable[[Peer], None]],
                 confirm: bool = True) -> FakeHolder:
    """The scripts, then (`confirm`) the list a custody's close asks on a connection of its
    own to confirm its end: every session deposited before, draining."""
    fake: FakeHolder | None = None

    def drained(peer: Peer) -> None:
        peer.expect(protocol.List)
        assert fake is not None
        ids = dict.fromkeys(m.id for connection in fake.received for m in connection
                            if isinstance(m, protocol.Deposit))
        peer.send(protocol.Sessions(sessions=[protocol.SessionInfo(
            owner=OWNER, id=sid, state="draining", deposited_at=1.5) for sid in ids]))

    fake = FakeHolder(tmp_path, [*scripts, drained] if confirm else scripts, concurrent=True,
                      timeout=15)
    return fake


def _hold(peer: Peer) -> None:
    """A holder that takes the deposit and holds it until the custody ends."""
    peer.send(protocol.Deposited(id=peer.expect(protocol.Deposit).id))
    peer.until_eof()


def _deposits(connection: list[protocol.Request]) -> list[str]:
    return [m.id for m in connection if isinstance(m, protocol.Deposit)]


def test_a_resume_the_new_holder_refuses_is_not_protected_and_is_tried_again(
        package: Path, node_apps: Callable[..., NodeApp], tmp_path: Path) -> None:
    gone = threading.Event()

    def first(peer: Peer) -> None:
        peer.send(protocol.Deposited(id=peer.expect(protocol.Deposit).id))
        assert gone.wait(15)  # then the holder goes away: the connection closes

    def refuse_then_hold(peer: Peer) -> None:
        sid = peer.expect(protocol.Deposit).id
        peer.send(protocol.Error(code="exists", message="escrowed, not for you", id=sid))
        peer.send(protocol.Deposited(id=peer.expect(protocol.Deposit).id))
        peer.until_eof()

    with _fake_holder(tmp_path, [first, refuse_then_hold]) as fake:
        app = node_apps(package, """
          const custody = await client.openCustody();
          custody.on('lapsed', () => say({event: 'lapsed', protected: custody.protected}));
          custody.on('protected', () => say({event: 'protected', protected: custody.protected}));
          const t = escrow._pty.open();
          await custody.deposit('tab', t.master, {});
          say({deposited: custody.protected});
          await next();
          await custody.close();
        """, fake.socket_path)
        assert app.next("the deposit") == {"deposited": True}
        gone.set()
        assert app.next("the lapse") == {"event": "lapsed", "protected": False}
        # 'protected' only once the holder holds it: after the refusal, a second try.
        assert app.next("protected") == {"event": "protected", "protected": True}
        assert _deposits(fake.received[1]) == ["tab", "tab"], fake.received
        app.send()
        assert app.wait() == 0


def test_a_deposit_with_no_answer_to_believe_is_held_read_and_settled_by_the_resume(
        package: Path, node_apps: Callable[..., NodeApp], tmp_path: Path) -> None:
    def misanswer(peer: Peer) -> None:
        sid = peer.expect(protocol.Deposit).id
        peer.send(protocol.Deposited(id="not-" + sid))  # another id: not the protocol
        peer.until_eof()

    with _fake_holder(tmp_path, [misanswer, _hold]) as fake:
        app = node_apps(package, """
          const custody = await client.openCustody();
          const t = escrow._pty.open();
          const settled = new Promise((r) => custody.once('protected', r));
          try { await custody.deposit('tab', t.master, {}); say({deposited: true}); }
          catch (e) { say({code: e.code, cause: e.cause && e.cause.code, id: e.id,
                           held: custody.fd('tab') === t.master, protected: custody.protected}); }
          await settled;
          custody.on('data', (id, b) => { if (b.includes('hello')) say({data: id}); });
          custody.startReading('tab');
          require('node:fs').writeSync(t.slave, 'hello\\n');
          await next();
          await custody.close();
        """, fake.socket_path)
        assert app.next("the deposit's answer") == {
            "code": "indeterminate", "cause": "protocol", "id": "tab", "held": True,
            "protected": False}
        assert app.next("its output, read once the resume settled it") == {"data": "tab"}
        assert _deposits(fake.received[1]) == ["tab"]
        app.send()
        assert app.wait() == 0


def test_a_deposit_refused_while_custody_lapsed_holds_nothing(
        package: Path, node_apps: Callable[..., NodeApp], tmp_path: Path) -> None:
    gone = threading.Event()

    def first(peer: Peer) -> None:
        peer.send(protocol.Deposited(id=peer.expect(protocol.Deposit).id))
        assert gone.wait(15)

    with _fake_holder(tmp_path, [first, _hold]) as fake:
        app = node_apps(package, """
          const custody = await client.openCustody();
          const a = escrow._pty.open(), b = escrow._pty.open();
          await custody.deposit('a', a.master, {});
          const lapsed = new Promise((r) => custody.once('lapsed', r));
          say({deposited: 'a'});
          await lapsed;
          const settled = new Promise((r) => custody.once('protected', r));
          let code = null, reading = null;
          try { await custody.deposit('b', b.master, {}); } catch (e) { code = e.code; }
          try { custody.startReading('b'); } catch (e) { reading = e.code; }
          say({code, fd: custody.fd('b'), reading});
          await settled;
          say({protected: custody.protected, fd: custody.fd('b')});
          await next();
          await custody.close();
        """, fake.socket_path)
        assert app.next("a's deposit") == {"deposited": "a"}
        gone.set()
        assert app.next("b's deposit") == {"code": "unavailable", "fd": -1, "reading": "unknown"}
        assert app.next("protected") == {"protected": True, "fd": -1}
        assert _deposits(fake.received[1]) == ["a"], fake.received  # b was never sent
        app.send()
        assert app.wait() == 0


def _journal_file() -> int:
    """A journal file of the layout the C writer maps (client/journal.py): a 4096-byte ring."""
    fd = os.memfd_create("journal")
    header = b"ESCROWJL" + struct.pack("<I", 2) + bytes(4) + struct.pack("<QQ", 4096, 4096)
    os.write(fd, header.ljust(8192, b"\0"))
    return fd


def test_journaled_is_what_the_c_custody_maps_after_a_resume_without_a_journal(
        package: Path, node_apps: Callable[..., NodeApp], tmp_path: Path) -> None:
    gone = threading.Event()

    def journal(peer: Peer) -> None:
        sid = peer.expect(protocol.Deposit).id
        fd = _journal_file()
        try:
            ring = protocol.Journal(capacity=4096, total=0, position=0)
            peer.send(protocol.Deposited(id=sid, journal=ring), fd)
        finally:
            os.close(fd)
        assert gone.wait(15)

    def without(peer: Peer) -> None:
        peer.send(protocol.Deposited(id=peer.expect(protocol.Deposit).id))  # no journal
        peer.until_eof()

    with _fake_holder(tmp_path, [journal, without]) as fake:
        app = node_apps(package, """
          const custody = await client.openCustody();
          const a = escrow._pty.open();
          await custody.deposit('a', a.master, {journal: true});
          const settled = new Promise((r) => custody.once('protected', r));
          say({journaled: custody.journaled('a')});
          await settled;
          say({journaled: custody.journaled('a')});
          await next();
          await custody.close();
        """, fake.socket_path)
        assert app.next("the deposit") == {"journaled": True}
        gone.set()
        assert app.next("the resume") == {"journaled": False}
        app.send()
        assert app.wait() == 0


def test_a_custody_is_refused_in_a_worker_which_ends_with_the_process_alive(
        package: Path, holder: HolderProcess) -> None:
    worker = (f"const escrow = require({str(package)!r});"
              "const { parentPort } = require('node:worker_threads');"
              f"new escrow.EscrowClient({{owner: {OWNER!r}, socket: {holder.socket!r}}})"
              ".openCustody().then(async (custody) => {"
              "  const t = escrow._pty.open();"
              "  await custody.deposit('w', t.master, {});"
              "  custody.on('data', () => {}); custody.startReading('w');"
              "  parentPort.postMessage({opened: true});"
              "}, (e) => parentPort.postMessage({refused: e.code}));")
    line = run_node(package, holder.socket, f"""
      const {{ Worker }} = require('node:worker_threads');
      const w = new Worker({json.dumps(worker)}, {{eval: true}});
      const said = await new Promise((r) => w.once('message', r));
      await w.terminate();
      await (await client.openCustody()).close();  // the main thread's is fine
      say(said);
    """)
    assert line == {"refused": "config"}
    assert state_of(holder, "w") is None


def test_a_second_close_is_the_first_ones_promise_and_ends_custody(
        package: Path, holder: HolderProcess) -> None:
    line = run_node(package, holder.socket, """
      const custody = await client.openCustody();
      const t = escrow._pty.open();
      await custody.deposit('tab', t.master, {});
      const first = custody.close(), second = custody.close();
      await second;
      const state = (await client.list()).find((s) => s.id === 'tab').state;
      await first;
      say({same: first === second, state});
    """)
    assert line == {"same": True, "state": "draining"}


# --- a close that could not be confirmed, and the watcher while a holder is stopped ---------------


def test_a_lapsed_custody_closed_with_no_holder_to_confirm_it_rejects(
        package: Path, node_apps: Callable[..., NodeApp], tmp_path: Path) -> None:
    """The holder goes away and none comes back: close() ends custody all the same, but
    rejects ('unavailable', unconfirmed), where it resolved as if every session drained."""
    gone = threading.Event()

    def first(peer: Peer) -> None:
        peer.send(protocol.Deposited(id=peer.expect(protocol.Deposit).id))
        assert gone.wait(15)

    with _fake_holder(tmp_path, [first], confirm=False) as fake:
        app = node_apps(package, """
          const c = new escrow.EscrowClient({owner: client.owner, socket: client.socket,
                                             timeout: 1});
          const custody = await c.openCustody();
          const t = escrow._pty.open();
          await custody.deposit('tab', t.master, {});
          const lapsed = new Promise((r) => custody.once('lapsed', r));
          say({deposited: true});
          await lapsed;
          try { await custody.close(); say({close: 'resolved'}); }
          catch (e) { say({close: 'rejected', code: e.code, message: e.message,
                           again: await custody.close().then(() => 'resolved', (e) => e.code)}); }
        """, fake.socket_path)
        assert app.next("the deposit") == {"deposited": True}
        gone.set()
        said = app.next("the close", timeout=30.0)
        assert said["close"] == "rejected" and said["code"] == "unavailable", said
        assert "unconfirmed" in said["message"] and said["again"] == "unavailable", said
        assert app.wait() == 0


def _traced(log: Path) -> tuple[str, ...]:
    """Run a Node app under strace, its poll(2) calls and its marks (kill(pid, 0)) in log."""
    return (require_program("strace"), "-f", "-qq", "-e", "trace=poll,kill", "-o", str(log))


def _polls_between_marks(log: Path, pid: int) -> list[tuple[int, int]]:
    """(thread, timeout ms) of each poll(2) the app entered between its two marks."""
    lines = log.read_text().splitlines()
    marks = [i for i, line in enumerate(lines) if f"kill({pid}, 0" in line]
    assert len(marks) >= 2, lines[-20:]
    polls = []
    for line in lines[marks[0] + 1:marks[1]]:
        found = re.match(r"(\d+)\s+poll\(\[.*?\], \d+, (-?\d+)", line)
        if found:
            polls.append((int(found.group(1)), int(found.group(2))))
    return polls


def test_a_call_owed_its_answer_by_a_stopped_holder_leaves_the_reads_alone(
    package: Path, holder: HolderProcess, pty_children: Callable[..., PtyChild],
    node_apps: Callable[..., NodeApp], tmp_path: Path,
) -> None:
    """An update times out on a SIGSTOPped holder: the connection stays open, owed the
    answer. The watcher tries no resume meanwhile (each waited for that answer up to the
    timeout, every read paused): while the app reads 100 more times not one poll(2) is made
    (strace). Once the holder runs again, the late answer makes it 'protected'."""
    child = counter(pty_children)
    log = tmp_path / "strace"
    app = node_apps(package, f"""
        const c = new escrow.EscrowClient({{owner: client.owner, socket: client.socket,
                                           timeout: 1}});
        const custody = await c.openCustody();
        await custody.deposit('tab', {child.master}, {{childPid: {child.pid}}});
        let lines = 0, enough = null;
        custody.on('data', (id, data) => {{
          lines += 1;  // a read each: a backlog read at once is one
          if (enough !== null && lines >= 100) {{ enough(); enough = null; }}
        }});
        custody.startReading('tab');
        say({{held: true}}); await next();
        const back = new Promise((r) => custody.once('protected', r));
        try {{ await custody.update('tab', {{cols: 81}}); say({{update: 'ok'}}); }}
        catch (e) {{ say({{update: e.code, protected: custody.protected}}); }}
        process.kill(process.pid, 0);
        lines = 0;
        await new Promise((r) => {{ enough = r; }});
        process.kill(process.pid, 0);
        say({{pid: process.pid, lines}}); await next();
        await back;
        say({{protected: custody.protected}});
        await custody.close();
    """, holder.socket, pass_fds=(child.master,), prefix=_traced(log))
    assert app.next("the deposit") == {"held": True}
    os.kill(holder.pid, signal.SIGSTOP)
    try:
        app.send()
        assert app.next("the update") == {"update": "unresponsive", "protected": False}
        read = app.next("100 reads with the holder stopped", timeout=30.0)
    finally:
        os.kill(holder.pid, signal.SIGCONT)
    app.send()
    assert app.next("the late answer") == {"protected": True}
    assert app.wait() == 0
    assert _polls_between_marks(log, read["pid"]) == []


def test_a_late_answer_half_arrived_is_read_off_the_main_thread(
        package: Path, node_apps: Callable[..., NodeApp], tmp_path: Path) -> None:
    """A deposit times out; then the first bytes of its answer come, and no more. Reading
    that answer waits up to the timeout: it runs off the main thread (no poll(2) with a
    timeout on the app's main thread, strace), where it stopped the event loop; the cut
    answer lapses the custody, and the resume holds the session again."""
    rejected = threading.Event()

    def half(peer: Peer) -> None:
        sid = peer.expect(protocol.Deposit).id
        assert rejected.wait(15)
        frame = protocol.encode(protocol.Deposited(id=sid))
        peer.sock.sendall(struct.pack(">I", len(frame))[:2])  # half a length prefix
        peer.until_eof()

    log = tmp_path / "strace"
    with _fake_holder(tmp_path, [half, _hold]) as fake:
        app = node_apps(package, """
          const c = new escrow.EscrowClient({owner: client.owner, socket: client.socket,
                                             timeout: 1});
          const custody = await c.openCustody();
          const t = escrow._pty.open();
          const back = new Promise((r) => custody.once('protected', r));
          try { await custody.deposit('tab', t.master, {}); } catch (e) { say({deposit: e.code}); }
          process.kill(process.pid, 0);
          await back;
          process.kill(process.pid, 0);
          say({pid: process.pid, protected: custody.protected});
          await next();
          await custody.close();
        """, fake.socket_path, prefix=_traced(log))
        assert app.next("the deposit") == {"deposit": "indeterminate"}
        rejected.set()
        said = app.next("protected again", timeout=30.0)
        assert said["protected"] is True
        app.send()
        assert app.wait() == 0
    polls = _polls_between_marks(log, said["pid"])
    assert polls, "the late answer was read"
    assert [p for p in polls if p[0] == said["pid"] and p[1] != 0] == [], polls


def test_a_session_retrieved_with_no_room_for_its_duplicate_is_read_never_ended(
    package: Path, holder: HolderProcess, pty_children: Callable[..., PtyChild],
    node_apps: Callable[..., NodeApp],
) -> None:
    """At the fd limit a retrieve into custody keeps no duplicate (escrow_custody_read says
    EBADF): the custody reads the fd the retrieve gave, 'data', where it said 'end' of a
    live terminal."""
    child = counter(pty_children)
    holder.client().hand_off("tab", child.master, child_pid=child.pid)
    wait_for(lambda: state_of(holder, "tab") == "draining", 5.0, "draining")
    app = node_apps(package, """
        const fs = require('node:fs');
        const custody = await client.openCustody();
        const said = [];
        custody.on('end', (id, errno) => { said.push('end'); say({end: errno}); });
        custody.on('data', (id) => { said.push('data'); if (said.length === 5) say({said}); });
        const fillers = [];
        try { for (;;) fillers.push(fs.openSync('/dev/null', 'r')); } catch (e) {}
        fs.closeSync(fillers.pop());  // room for the master alone
        const r = await custody.retrieve('tab', {journal: false});
        for (const f of fillers) fs.closeSync(f);
        say({held: custody.fd('tab') === r.fd, protected: custody.protected});
        custody.startReading('tab');
        await next();
        await custody.release('tab');
        await custody.close();
    """, holder.socket, prefix=(require_program("prlimit"), "--nofile=64"))
    assert app.next("the retrieve") == {"held": True, "protected": False}
    assert app.next("its output") == {"said": ["data"] * 5}
    app.send()
    assert app.wait() == 0


# --- a PTY library reads the master, and the app records what it read ---------------------------


def test_a_master_read_by_a_tty_stream_is_recorded_and_replayed_after_sigkill(
    package: Path, holder: HolderProcess, pty_children: Callable[..., PtyChild],
    node_apps: Callable[..., NodeApp],
) -> None:
    """A PTY library's stream reads the master (tty.ReadStream, as node-pty's does):
    startReading fails with errno EEXIST, and the app records each chunk it read, while
    updates keep a custody call running most of the time (those records wait for the call),
    up to L40. The app is SIGKILLed: the next replay has every line from L1 on, once, in
    order."""
    child = counter(pty_children)
    app = node_apps(package, f"""
        const custody = await client.openCustody();
        await custody.deposit('tab', {child.master}, {{childPid: {child.pid}, journal: true}});
        const stream = new (require('node:tty').ReadStream)({child.master});
        let seen = '', calling = 0, during = 0, told = false;
        stream.on('data', (bytes) => {{
          if (calling) during++;
          custody.record('tab', bytes);
          seen += bytes.toString('latin1');
          if (!told && /L40\\r?\\n/.test(seen)) told = true;
        }});
        await new Promise((r) => stream.once('data', r));  // the stream polls the master
        let started = null;
        try {{ custody.startReading('tab'); }}
        catch (e) {{ started = {{code: e.code, errno: e.errno, id: e.id}}; }}
        say({{started, journaled: custody.journaled('tab')}});
        for (let k = 0; !told; k++) {{
          calling++;
          await custody.update('tab', {{cols: 80 + (k % 2), rows: 24}});
          calling--;
        }}
        say({{during}});  // no call runs now: each chunk is recorded as it is read
        await new Promise(() => {{}});
    """, holder.socket, pass_fds=(child.master,))
    assert app.next("startReading") == {
        "started": {"code": "system", "errno": 17, "id": "tab"}, "journaled": True}
    assert app.next("40 lines read")["during"] > 0
    app.proc.send_signal(signal.SIGKILL)
    app.wait()
    wait_for(lambda: state_of(holder, "tab") == "draining", 5.0, "draining")
    got = holder.client().retrieve("tab")
    try:
        assert got.replay_journaled > 0
        assert_gap_free_from_1(read_more_lines(got.fd, got.replay, 3))
    finally:
        os.close(got.fd)


def test_a_master_the_app_closed_ends_with_ebadf_and_the_process_lives(
    package: Path, holder: HolderProcess, node_apps: Callable[..., NodeApp],
) -> None:
    """The app closes a master the custody holds and reads, then makes a call: the read
    ends with 'end' errno 9 (EBADF, the app's doing, not EIO's hang-up), startReading says
    so, and the app, its custody and its other session go on (libuv aborted the process
    polling the closed fd)."""
    app = node_apps(package, """
        const fs = require('node:fs');
        const custody = await client.openCustody();
        const a = escrow._pty.open(), b = escrow._pty.open();
        await custody.deposit('a', a.master, {});
        await custody.deposit('b', b.master, {});
        const ended = new Promise((r) => custody.once('end', (id, errno) => r({id, errno})));
        const alive = new Promise((r) => custody.on('data', (id, bytes) => {
          if (id === 'b') r(bytes.toString()); }));
        custody.startReading('a');
        fs.closeSync(a.master);
        await custody.update('a', {cols: 100, rows: 30});
        say({end: await ended});
        let again = null;
        try { custody.startReading('a'); } catch (e) { again = {code: e.code, errno: e.errno}; }
        custody.startReading('b');
        fs.writeSync(b.slave, 'alive\\n');
        say({again});
        say({b: await alive});
        await custody.release('a');
        await custody.close();
    """, holder.socket)
    assert app.next("a's end") == {"end": {"id": "a", "errno": 9}}
    assert app.next("startReading again") == {"again": {"code": "system", "errno": 9}}
    assert "alive" in app.next("b read")["b"]
    assert app.wait() == 0


def test_a_lapsed_custody_keeps_the_process_alive_until_a_holder_comes_back(
        package: Path, node_apps: Callable[..., NodeApp], tmp_path: Path) -> None:
    """The holder goes away and the app's only pending work is awaiting 'protected' (stdin
    closed, its own timer cleared at 'lapsed'): the process stays, its resumes fail against
    a socket that hangs up, a back-off apart, and once a holder answers it sees
    'protected'."""
    gone = threading.Event()

    def first(peer: Peer) -> None:
        peer.send(protocol.Deposited(id=peer.expect(protocol.Deposit).id))
        assert gone.wait(15)

    link = tmp_path / "escrowd.sock"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    hangup = tmp_path / "hangup.sock"
    refusals: list[int] = []
    with _fake_holder(tmp_path / "a", [first], confirm=False) as fake, \
            socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(hangup))
        listener.listen(8)
        listener.settimeout(0.2)

        def hang_up() -> None:
            while len(refusals) < 3:
                try:
                    conn, _ = listener.accept()
                except OSError:
                    continue
                conn.close()
                refusals.append(1)

        link.symlink_to(fake.socket_path)
        app = node_apps(package, """
          const custody = await client.openCustody();
          const t = escrow._pty.open();
          await custody.deposit('tab', t.master, {});
          const keep = setInterval(() => {}, 1000);  // while protected nothing else would
          const lapsed = new Promise((r) => custody.once('lapsed', () => {
            clearInterval(keep);
            r();
          }));
          const back = new Promise((r) => custody.once('protected', r));
          lines.close();
          process.stdin.destroy();
          say({deposited: true});
          await lapsed;
          say({lapsed: true});
          await back;
          say({protected: custody.protected});
          await custody.close();
        """, str(link))
        assert app.next("the deposit") == {"deposited": True}
        waiter = threading.Thread(target=hang_up, daemon=True)
        waiter.start()
        link.unlink()
        link.symlink_to(hangup)
        gone.set()
        assert app.next("the lapse") == {"lapsed": True}
        waiter.join(30)
        assert len(refusals) == 3 and app.proc.poll() is None, "the process lived on"
        with _fake_holder(tmp_path / "b", [_hold]) as back:
            link.unlink()
            link.symlink_to(back.socket_path)
            assert app.next("protected") == {"protected": True}
            assert app.wait() == 0
