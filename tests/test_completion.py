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
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import test_attach
from test_attach import OUTER, Screens

from conftest import HolderProcess, PtyChild, require_program
from escrow_client import completion
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
