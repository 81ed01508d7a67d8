"""`escrowctl completion bash|zsh|fish` (escrow_client.completion), in the real shells.

Each script is loaded as the docs say (bash: `source <(...)`; zsh: a file `_escrowctl` in
$fpath before compinit; fish: a file sourced, asked with `complete -C`) and completes a
verb, an option, and the id of a session a real holder holds: bash and zsh by a Tab
pressed in a tmux pane, read off its screen. One id has a colon in its owner, which
bash's readline splits words at.
"""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import test_attach
from fakeholder import WELCOME, FakeHolder, Peer
from test_attach import OUTER, Screens

from conftest import HolderProcess, PtyChild, require_program
from escrow_client import completion, protocol
from escrow_client.parser import VERBS

screens = test_attach.screens  # the fixture: tmux servers, ended at teardown
ESCROWCTL = Path(sys.executable).with_name("escrowctl")
SESSIONS = ("com.example.term/tab-1", "org.example:app/w@1")


def hold_sessions(holder: HolderProcess, pty_children: Callable[..., PtyChild]) -> None:
    for ref in SESSIONS:
        owner, _, sid = ref.partition("/")
        child = pty_children(["sh", "-c", "exec sleep 60"])
        holder.client(owner).hand_off(sid, child.master, child_pid=child.pid, label="sh")
        os.close(child.master)
        child.master = -1


def env_for(holder_socket: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env["ESCROW_SOCKET"] = holder_socket
    env["PATH"] = f"{ESCROWCTL.parent}:{env.get('PATH', '/usr/bin:/bin')}"
    return env


def complete_in(pane: test_attach.Pane, typed: str, expected: str) -> None:
    """Type `typed` and a Tab: the line becomes `expected`; then the line is cleared."""
    pane.keys("-l", typed)
    pane.keys("Tab")
    pane.wait_screen(lambda s: s.rstrip().rsplit("\n", 1)[-1].rstrip().endswith(expected),
                     f"{typed!r} + Tab to complete to {expected!r}")
    pane.keys("C-u")


def test_bash_completes_verbs_options_and_live_sessions(
        screens: Screens, holder: HolderProcess,
        pty_children: Callable[..., PtyChild]) -> None:
    hold_sessions(holder, pty_children)
    pane = screens.pane("bash", cols=120)
    pane.line("source <(escrowctl completion bash)")
    pane.wait_prompt(OUTER)
    complete_in(pane, "escrowctl att", "escrowctl attach")
    complete_in(pane, "escrowctl list --ow", "escrowctl list --owner")
    complete_in(pane, "escrowctl --timeout 3 st", "escrowctl --timeout 3 st")  # status, stop
    complete_in(pane, "escrowctl attach com", "escrowctl attach com.example.term/tab-1")
    complete_in(pane, "escrowctl release org.example:a", "escrowctl release org.example:app/w@1")
    complete_in(pane, "escrowctl completion f", "escrowctl completion fish")


def test_zsh_completes_from_fpath(screens: Screens, holder: HolderProcess,
                                  pty_children: Callable[..., PtyChild]) -> None:
    require_program("zsh")
    hold_sessions(holder, pty_children)
    functions = screens.dir / "zfunc"
    functions.mkdir()
    (functions / "_escrowctl").write_text(completion.script("zsh"))
    pane = screens.pane("zsh", cols=120)
    pane.line(f"exec env PS1='zsh$ ' ZDOTDIR={shlex.quote(str(screens.dir))} zsh -f")
    pane.wait_prompt("zsh$ ")
    pane.line(f"bindkey -e; fpath=({shlex.quote(str(functions))} $fpath); "
              "autoload -U compinit; compinit -u -D")
    pane.wait_prompt("zsh$ ")
    complete_in(pane, "escrowctl att", "escrowctl attach")
    complete_in(pane, "escrowctl list --ow", "escrowctl list --owner")
    complete_in(pane, "escrowctl attach com", "escrowctl attach com.example.term/tab-1")
    complete_in(pane, "escrowctl release org", "escrowctl release org.example:app/w@1")


def fish_complete(script: Path, line: str, env: dict[str, str]) -> list[str]:
    result = subprocess.run(
        ["fish", "--no-config", "-c", f"source {shlex.quote(str(script))}; "
         f"complete -C {shlex.quote(line)}"],
        capture_output=True, text=True, timeout=30, env=env, stdin=subprocess.DEVNULL)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    return [candidate.split("\t")[0] for candidate in result.stdout.splitlines()]


def test_fish_completes_verbs_options_and_live_sessions(
        holder: HolderProcess, pty_children: Callable[..., PtyChild], tmp_path: Path) -> None:
    require_program("fish")
    hold_sessions(holder, pty_children)
    script = tmp_path / "escrowctl.fish"
    script.write_text(completion.script("fish"))
    env = env_for(holder.socket)
    assert fish_complete(script, "escrowctl ", env) == sorted(name for name, _, _ in VERBS)
    assert fish_complete(script, "escrowctl att", env) == ["attach"]
    assert fish_complete(script, "escrowctl list --ow", env) == ["--owner"]
    assert "--detach-key" in fish_complete(script, "escrowctl attach --", env)
    assert fish_complete(script, "escrowctl attach ", env) == sorted(SESSIONS)
    assert fish_complete(script, "escrowctl --timeout 2 release org", env) == [SESSIONS[1]]
    assert fish_complete(script, "escrowctl list ", env) == []  # list takes no session
    # The socket on the line is the holder asked, whatever $ESCROW_SOCKET says.
    elsewhere = {**env, "ESCROW_SOCKET": str(tmp_path / "none.sock")}
    assert fish_complete(script, "escrowctl attach ", elsewhere) == []
    assert fish_complete(script, f"escrowctl --socket {holder.socket} attach ",
                         elsewhere) == sorted(SESSIONS)


def complete_sessions(*words: str, env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str],
                                                                  float]:
    started = time.monotonic()
    result = subprocess.run([str(ESCROWCTL), "_complete", "sessions", *words],
                            capture_output=True, text=True, timeout=30, env=env,
                            stdin=subprocess.DEVNULL)
    return result, time.monotonic() - started


def test_session_ids_without_a_holder_are_nothing_and_start_none(tmp_path: Path) -> None:
    """No holder: no output, exit 0, and no holder started (nothing on the socket's path)."""
    short = Path(os.path.realpath("/tmp")) / f"esc-cmp-{os.getpid()}"
    short.mkdir(mode=0o700)
    try:
        sock = short / "escrowd.sock"
        result, _ = complete_sessions("attach", env=env_for(str(sock)))
        assert (result.returncode, result.stdout, result.stderr) == (0, "", "")
        result, _ = complete_sessions("--socket", str(tmp_path / "x" / "s.sock"), "attach",
                                      env=env_for(str(sock)))
        assert (result.returncode, result.stdout, result.stderr) == (0, "", "")
        assert sorted(os.listdir(short)) == []
    finally:
        os.rmdir(short)


def test_session_ids_from_a_holder_that_never_answers_are_nothing_soon() -> None:
    """A socket that accepts and never answers (a wedged holder) costs a Tab about a second."""
    short = Path(os.path.realpath("/tmp")) / f"esc-cmp-w{os.getpid()}"
    short.mkdir(mode=0o700)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(short / "escrowd.sock"))
        listener.listen(8)
        result, took = complete_sessions(env=env_for(str(short / "escrowd.sock")))
        assert (result.returncode, result.stdout, result.stderr) == (0, "", "")
        assert took < completion.SESSIONS_TIMEOUT + 2.0
    finally:
        listener.close()
        for name in os.listdir(short):
            os.unlink(short / name)
        os.rmdir(short)


@pytest.mark.parametrize("shell", completion.SHELLS)
def test_every_verb_is_in_every_script(shell: str) -> None:
    """The scripts are written from VERBS: a verb added there is completed."""
    script = completion.script(shell)
    for name, _, _ in VERBS:
        assert name in script
    takes_session = [v.name for v in completion.command_line()[1] if v.sessions]
    assert {"attach", "release"} <= set(takes_session)


def test_bash_completes_after_an_equals_sign_and_after_a_double_dash(
        screens: Screens, holder: HolderProcess,
        pty_children: Callable[..., PtyChild]) -> None:
    """bash breaks words at `=`: `--socket=PATH` and `--timeout=N` are one option with its
    value. After `run --` comes a command line of its own: command names, then files."""
    hold_sessions(holder, pty_children)
    pane = screens.pane("bash", cols=160)
    pane.line("source <(escrowctl completion bash)")
    pane.wait_prompt(OUTER)
    complete_in(pane, "escrowctl --timeout=3 att", "escrowctl --timeout=3 attach")
    complete_in(pane, f"escrowctl --socket={holder.socket} attach com",
                f"escrowctl --socket={holder.socket} attach com.example.term/tab-1")
    directory = os.path.dirname(holder.socket)
    complete_in(pane, f"escrowctl --socket={directory[:-1]}", f"escrowctl --socket={directory}")
    complete_in(pane, "escrowctl run -- slee", "escrowctl run -- sleep")
    complete_in(pane, "escrowctl run -- cat /etc/host", "escrowctl run -- cat /etc/host")
    complete_in(pane, "escrowctl run -- cat /etc/hostn", "escrowctl run -- cat /etc/hostname")


def hostile_sessions(mark: Path) -> Callable[[Peer], None]:
    """A listener on the socket, of our own uid, answering `list` with ids a shell would
    run (creating `mark`) or glob, beside one that is a name."""
    def script(peer: Peer) -> None:
        peer.expect(protocol.List)
        ids = [f"$(touch {mark})", f"`touch {mark}`", "tab-*", "tab 2", "tab-1"]
        peer.send(protocol.Sessions(sessions=[
            protocol.SessionInfo(owner="com.example.term", id=sid, state="held")
            for sid in ids]))
    return script


def test_bash_runs_nothing_a_holder_sends(screens: Screens, socket_dir: Path) -> None:
    """Only ids that are protocol names are offered, and bash adds them by matching, not
    through `compgen -W` (which expands `$(...)`) or an unquoted `$(...)` (which globs)."""
    mark = screens.dir / "ran"
    with FakeHolder(socket_dir, [hostile_sessions(mark)], repeat_last=True) as fake:
        result, _ = complete_sessions("--socket", fake.socket_path, "attach",
                                      env=env_for(fake.socket_path))
        assert result.stdout == "com.example.term/tab-1\n"
        pane = screens.pane("bash", cols=160)
        pane.line("source <(escrowctl completion bash)")
        pane.wait_prompt(OUTER)
        complete_in(pane, f"escrowctl --socket {fake.socket_path} attach com",
                    f"escrowctl --socket {fake.socket_path} attach com.example.term/tab-1")
    assert not mark.exists()


def test_zsh_and_fish_complete_the_command_after_a_double_dash(
        screens: Screens, holder: HolderProcess, tmp_path: Path) -> None:
    require_program("zsh")
    require_program("fish")
    functions = screens.dir / "zfunc"
    functions.mkdir()
    (functions / "_escrowctl").write_text(completion.script("zsh"))
    pane = screens.pane("zsh", cols=120)
    pane.line(f"exec env PS1='zsh$ ' ZDOTDIR={shlex.quote(str(screens.dir))} zsh -f")
    pane.wait_prompt("zsh$ ")
    pane.line(f"bindkey -e; fpath=({shlex.quote(str(functions))} $fpath); "
              "autoload -U compinit; compinit -u -D")
    pane.wait_prompt("zsh$ ")
    complete_in(pane, "escrowctl run -- slee", "escrowctl run -- sleep")
    complete_in(pane, "escrowctl run -- cat /etc/hostn", "escrowctl run -- cat /etc/hostname")
    complete_in(pane, "escrowctl install-service -- --ver", "escrowctl install-service -- --ver")
    script = tmp_path / "escrowctl.fish"
    script.write_text(completion.script("fish"))
    env = env_for(holder.socket)
    assert fish_complete(script, "escrowctl run -- slee", env) == ["sleep"]
    assert fish_complete(script, "escrowctl run -- cat /etc/hostn", env) == ["/etc/hostname"]
    assert "--detach-key" in fish_complete(script, "escrowctl run --det", env)
    assert "--detach-key" not in fish_complete(script, "escrowctl run -- sh --det", env)


def test_session_ids_on_a_socket_named_with_a_tilde(
        holder: HolderProcess, pty_children: Callable[..., PtyChild]) -> None:
    """`--socket ~/x` is the socket in $HOME, as the shell would have expanded it."""
    hold_sessions(holder, pty_children)
    home, name = os.path.split(holder.socket)
    env = {**env_for("/nonexistent/escrowd.sock"), "HOME": home}
    result, _ = complete_sessions("--socket", f"~/{name}", "attach", env=env)
    assert sorted(result.stdout.splitlines()) == sorted(SESSIONS)
    result, _ = complete_sessions(f"--socket=~/{name}", "attach", env=env)
    assert sorted(result.stdout.splitlines()) == sorted(SESSIONS)


def test_session_ids_from_a_listener_that_trickles_are_nothing_within_the_second(
        socket_dir: Path) -> None:
    """A listener that sends its welcome a byte every 0.3 s never lets a socket timeout
    pass: the Tab's one deadline, and its alarm, still end it within about a second."""
    path = str(socket_dir / "trickle.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)
    done = threading.Event()

    def trickle() -> None:
        connection, _ = listener.accept()
        with connection:
            for byte in protocol.encode(WELCOME):
                if done.wait(0.3):  # the listener's pace; the test's end stops it
                    return
                try:
                    connection.send(bytes([byte]))
                except OSError:
                    return

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    try:
        result, took = complete_sessions("attach", env=env_for(path))
        assert (result.returncode, result.stdout, result.stderr) == (0, "", "")
        assert took < 1.5
    finally:
        done.set()
        listener.close()
        thread.join(5)
