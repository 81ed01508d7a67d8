"""Every code example in the README and in docs/ runs as written, against a real holder.

The examples are read out of the Markdown, not copied: a `python` block runs as a program of
its own (the README's library example twice in a row, as it says), each line of a `sh` block
runs as a command (in a tmux pane for `escrowctl run` and `attach`, which need a terminal),
the C example compiles and runs against a holder, and the demo's output shown in the README
is held to what `escrowctl demo` prints. A command that cannot run here as written (it runs
this suite, installs into the user's account, or needs launchd) is listed in NOT_RUN with
the test that covers it, and every command of every block must be one or the other.

The holder each test starts is on a socket of its own, given as `$ESCROW_SOCKET`, which is
the first place the examples' default socket is looked up.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import test_attach
from test_attach import OUTER, RUN_OWNER, Screens, detach, state

from conftest import HolderProcess, require_program, wait_for
from escrow_client import EscrowClient

screens = test_attach.screens  # the fixture: tmux servers, ended at teardown

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "client/c/README.md",
        REPO / "client/node/README.md"]
VENV_BIN = REPO / ".venv" / "bin"

# What cannot run here as written, and the test that runs it (or its equivalent) instead.
NOT_RUN: dict[str, tuple[str, str]] = {
    "scripts/test": ("it runs this suite", ".ci/run"),
    "pipx install .": ("installs into the user's account",
                       "tests/test_packaging.py::test_pipx_install_as_the_readme_says"),
    "pipx ensurepath": ("edits the user's shell profile; the packaging test puts pipx's bin "
                        "directory on PATH itself",
                        "tests/test_packaging.py::test_pipx_install_as_the_readme_says"),
    'export PATH="$HOME/.local/bin:$PATH"': (
        "changes the PATH of the shell it is pasted into",
        "tests/test_readme_install.py::test_the_readme_install_and_removal_work_as_pasted"),
    "escrowctl uninstall-service": (
        "removes the user's service files",
        "tests/test_readme_install.py::test_the_readme_install_and_removal_work_as_pasted"),
    "pipx uninstall": (
        "uninstalls from the user's account",
        "tests/test_readme_install.py::test_the_readme_install_and_removal_work_as_pasted"),
    "escrowctl install-service": (
        "writes the user's service files",
        "tests/test_install_service.py::test_install_service_writes_units_that_systemd_accepts"),
    "systemctl --user": ("needs the user's systemd",
                         "tests/test_under_systemd.py::test_socket_activation_and_notify"),
    "journalctl --user": ("needs the user's systemd",
                          "tests/test_under_systemd.py::test_socket_activation_and_notify"),
    "escrowctl status               # the first": (
        "the first connection of a systemd socket unit",
        "tests/test_under_systemd.py::test_socket_activation_and_notify"),
    "escrowctl status                        # the first": (
        "the first connection of a systemd socket unit",
        "tests/test_under_systemd.py::test_socket_activation_and_notify"),
    "source <(escrowctl completion bash)": (
        "loads into the shell that runs it", "tests/test_completion.py::"
        "test_bash_completes_verbs_options_and_live_sessions"),
    "escrowctl completion bash >": (
        "writes into the user's home", "tests/test_completion.py::"
        "test_bash_completes_verbs_options_and_live_sessions"),
    "escrowctl completion zsh >": (
        "writes into the user's home", "tests/test_completion.py::test_zsh_completes_from_fpath"),
    "escrowctl completion fish >": (
        "writes into the user's home", "tests/test_completion.py::"
        "test_fish_completes_verbs_options_and_live_sessions"),
    "launchctl": ("macOS only", "tests/test_install_service.py::"
                  "test_launchd_agent_as_installed_runs_a_holder_on_its_pinned_socket"),
    "tail -f ~/Library/Logs/escrowd.log": (
        "macOS only", "tests/test_install_service.py::"
        "test_launchd_agent_as_installed_runs_a_holder_on_its_pinned_socket"),
}

# The blocks the tests below run (a block is named by its document, its kind and a line of
# it): every other block must be wholly NOT_RUN, and so must every command of a block here
# that its test does not run (PARTLY_RUN).
RUN_HERE = [
    ("README.md", "sh", "scripts/holder"),
    ("README.md", "sh", "escrowctl demo"),
    ("README.md", "text", "same process"),
    ("docs/escrowctl.md", "text", "same process"),
    ("README.md", "python", "custody"),
    ("docs/escrowctl.md", "sh", "escrowctl upgrade"),
    ("docs/library.md", "python", "hand_off"),
    ("README.md", "sh", "escrowctl run --id work"),
    ("docs/escrowctl.md", "sh", "escrowctl run --id work"),
    ("client/c/README.md", "sh", "cc "),
    ("client/c/README.md", "c", "escrow_retrieve"),
    # tests/test_node_client.py runs these two
    ("client/node/README.md", "sh", "npm ci"),
    ("client/node/README.md", "js", "reclaimAll"),
]

PARTLY_RUN = {("README.md", "scripts/holder"): {"scripts/holder"}}


@dataclass
class Block:
    path: Path
    line: int  # of the opening fence
    lang: str
    text: str

    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    found, lines = [], path.read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("```"):
            start, lang = i, lines[i][3:].strip()
            i += 1
            body = []
            while not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            found.append(Block(path, start + 1, lang, "\n".join(body) + "\n"))
        i += 1
    return found


def all_blocks(lang: str) -> list[Block]:
    return [b for path in DOCS for b in blocks(path) if b.lang == lang]


@dataclass
class Command:
    raw: str  # the line as the document has it, comment and all
    text: str  # the command alone
    exit: int  # the exit status the comment names ("exit 3: ..."), else 0


def commands(block: Block) -> list[Command]:
    """Each command of a `sh` block: a line that is not a comment, with any line ending in
    a backslash joined to the next; the comment after `#` is dropped."""
    out, pending = [], ""
    for raw in block.text.splitlines():
        if not raw.strip() or (raw.lstrip().startswith("#") and not pending):
            continue
        code, _, comment = raw.partition("  #")
        if code.rstrip().endswith("\\"):
            pending += code.rstrip()[:-1] + " "
            continue
        status = re.match(r"\s*exit (\d+)", comment)
        out.append(Command(pending + raw, (pending + code).strip(),
                           int(status.group(1)) if status else 0))
        pending = ""
    return out


def not_run(command: Command) -> tuple[str, str] | None:
    for prefix, why in NOT_RUN.items():
        if command.raw.startswith(prefix) or command.text.startswith(prefix):
            return why
    return None


def block_with(lang: str, path: Path, needle: str) -> Block:
    [block] = [b for b in blocks(path) if b.lang == lang and needle in b.text]
    return block


def doc_env(holder_socket: str, home: Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ESCROW_SOCKET")}
    env["ESCROW_SOCKET"] = holder_socket
    # `escrowctl` as the docs write it is the one on PATH: this checkout's.
    env["PATH"] = f"{VENV_BIN}:{env.get('PATH', '/usr/bin:/bin')}"
    if home is not None:
        env["HOME"] = str(home)
    return env


def sh(command: Command, env: dict[str, str], timeout: float = 60.0) -> str:
    """Run one command of a `sh` block from the repository, as a user pastes it."""
    result = subprocess.run(["bash", "-c", command.text], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=timeout,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == command.exit, (
        f"{command.raw!r} exited {result.returncode}, the docs say {command.exit}\n"
        f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}")
    assert "Traceback" not in result.stdout + result.stderr
    return result.stdout


def python_block(block: Block, env: dict[str, str], directory: Path) -> str:
    """Run a `python` block as a program of its own, from a directory of its own (the
    package is the installed one, not the checkout's source on sys.path)."""
    program = directory / f"example_{block.line}.py"
    program.write_text(block.text)
    result = subprocess.run([sys.executable, str(program)], cwd=directory, env=env,
                            capture_output=True, text=True, timeout=60,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 0, (
        f"{block.where()} exited {result.returncode}\n{result.stdout}\n{result.stderr}")
    return result.stdout


@pytest.fixture
def workdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="esc-doc-"))
    os.chmod(d, 0o700)
    yield d
    subprocess.run(["rm", "-rf", str(d)], check=False)


# --- every command is run, or named with the test that covers it ----------------------


def test_every_example_in_the_docs_is_run_or_covered() -> None:
    """Each block is run by a test below (RUN_HERE), or each of its commands is listed in
    NOT_RUN with a test that exists and covers it."""
    for doc, lang, needle in RUN_HERE:
        block_with(lang, REPO / doc, needle)  # there, and only once
    for block in (b for path in DOCS for b in blocks(path)):
        doc = str(block.path.relative_to(REPO))
        run_here = [(d, needle) for d, lang, needle in RUN_HERE
                    if d == doc and lang == block.lang and needle in block.text]
        ran: set[str] = set()
        if run_here:
            if run_here[0] not in PARTLY_RUN:
                continue
            ran = PARTLY_RUN[run_here[0]]
        assert block.lang == "sh", f"{block.where()}: a {block.lang!r} block nobody runs"
        for command in commands(block):
            if command.text in ran:
                continue
            covered = not_run(command)
            assert covered is not None, f"{block.where()}: {command.raw!r} is never run"
            test = covered[1]
            if test == ".ci/run":
                assert "scripts/test" in (REPO / ".ci/run").read_text()
                continue
            file, _, name = test.partition("::")
            assert f"def {name}(" in (REPO / file).read_text(), f"{test} is not there"


# --- the README ------------------------------------------------------------------------


def test_scripts_holder_runs_the_holder_in_the_foreground(workdir: Path) -> None:
    """`scripts/holder`, as pasted (the default socket is `$ESCROW_SOCKET` here): a holder
    under its keeper that answers, and that Ctrl-C with nothing escrowed stops."""
    [command] = [c for b in all_blocks("sh") if b.path.name == "README.md"
                 for c in commands(b) if c.text == "scripts/holder"]
    sock = str(workdir / "escrowd.sock")
    with open(workdir / "out.log", "wb") as log:
        proc = subprocess.Popen(["bash", "-c", command.text], cwd=REPO, env=doc_env(sock),
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    try:
        wait_for(lambda: " event=ready " in (workdir / "out.log").read_text(), 60.0,
                 "the holder of scripts/holder")
        status = subprocess.run([VENV_BIN / "escrowctl", "status"], env=doc_env(sock),
                                capture_output=True, text=True, timeout=20)
        assert status.returncode == 0 and "running" in status.stdout, status
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(20) == 0, (workdir / "out.log").read_text()


def test_the_tour_and_the_demo_it_shows(make_holder: Callable[..., HolderProcess]) -> None:
    """The tour's commands, in order, against a holder under its keeper; the demo's lines
    the README shows are lines the demo prints (its pids, sizes and id aside)."""
    holder = make_holder(keeper=True)
    tour = block_with("sh", REPO / "README.md", "escrowctl demo")
    outputs = [sh(c, doc_env(holder.socket)) for c in commands(tour)]
    demo = outputs[0]

    def shape(line: str) -> str:
        line = re.sub(r"demo-[0-9a-f]+", "demo-ID", line.strip())
        line = re.sub(r"/\S+/escrowd\.sock", "SOCKET", line)
        return re.sub(r"\d+", "N", line)

    def runs(lines: list[str]) -> list[str]:  # how many ticks each part shows varies
        return [line for i, line in enumerate(lines) if i == 0 or line != lines[i - 1]]

    printed = runs([shape(line) for line in demo.splitlines()])
    for doc in ("README.md", "docs/escrowctl.md"):
        at = 0
        shown = block_with("text", REPO / doc, "same process").text.splitlines()
        for want in runs([shape(line) for line in shown if line.strip() != "..."]):
            assert want in printed[at:], f"{doc} shows {want!r}; the demo printed:\n{demo}"
            at = printed.index(want, at) + 1
    assert "running" in outputs[1]


def test_the_library_example_runs_twice_then_escrowctl_takes_it_from_there(
        make_holder: Callable[..., HolderProcess], workdir: Path) -> None:
    """The README's library example, run twice: the first run starts a shell and deposits
    it, the second takes it back with its replay (the journal's: the first run's output)
    and the same shell. Then docs/escrowctl.md's first block, in its order, on the session
    the example left: status, list, stop refused, upgrade, release, stop, status."""
    holder = make_holder(keeper=True)
    env = doc_env(holder.socket)
    example = block_with("python", REPO / "README.md", "custody")
    first = python_block(example, env, workdir)
    assert "tab-1 is back" not in first and "hello from" in first, first
    client = EscrowClient("com.example.term", socket_path=holder.socket)
    [info] = client.list()
    assert info.state == "draining" and (info.cols, info.rows) == (80, 24)
    shell = info.child_pid
    assert shell is not None and psutil.pid_exists(shell)

    second = python_block(example, env, workdir)
    assert "tab-1 is back at 80x24" in second, second
    assert f"hello from {shell}" in second.split("bytes of replay:", 1)[1], second
    assert second.count(f"hello from {shell}") >= 2, second  # in the replay, then live
    [info] = client.list()
    assert info.state == "draining" and info.child_pid == shell

    reference = block_with("sh", REPO / "docs/escrowctl.md", "escrowctl upgrade")
    outputs = {c.text: sh(c, env) for c in commands(reference)}
    assert "com.example.term/tab-1" in outputs["escrowctl list"]
    assert "tab-1" in outputs["escrowctl --json list --owner com.example.term"]
    wait_for(lambda: holder.proc.poll() is not None, 20.0, "the keeper to exit")
    wait_for(lambda: not alive(shell), 10.0, "the released shell to hang up")


def test_the_library_pages_example_autostarts_and_runs_twice(workdir: Path) -> None:
    """docs/library.md's example of an app with no custody: with no holder on the socket it
    starts one (autostart), hands its shell off; run again, it takes the shell back."""
    sock = str(workdir / "run" / "escrowd.sock")
    os.mkdir(workdir / "run", 0o700)
    env = doc_env(sock)
    example = block_with("python", REPO / "docs/library.md", "hand_off")
    try:
        first = python_block(example, env, workdir)
        assert "hello from" in first and "is back" not in first, first
        second = python_block(example, env, workdir)
        assert "tab-1 is back, 80x24" in second, second
    finally:
        client = EscrowClient("com.example.plain", socket_path=sock)
        for info in client.list():
            if info.state == "draining":
                client.release(info.id)
        stop = subprocess.run([VENV_BIN / "escrowctl", "--socket", sock, "stop"],
                              capture_output=True, text=True, timeout=30)
        assert stop.returncode in (0, 3), stop


# --- attach and run, on a screen ---------------------------------------------------------


@pytest.mark.parametrize("doc", ["README.md", "docs/escrowctl.md"])
def test_run_and_attach_as_the_docs_write_them(doc: str, screens: Screens,
                                               holder: HolderProcess) -> None:
    """Each line typed into a terminal (a tmux pane, in the repository): `run` starts a
    shell in a new session, Ctrl-\\ detaches, `list` names it, `attach` takes it up with
    the same shell."""
    block = block_with("sh", REPO / doc, "escrowctl run --id work")
    pane = screens.pane("docs", cols=100, rows=30)
    pane.line(f"cd {shlex.quote(str(REPO))}")
    pane.wait_prompt(OUTER)
    shell = None
    for command in commands(block):
        verb = shlex.split(command.text)[1]
        if verb in ("run", "attach"):
            pane.line(command.text)
            wait_for(lambda: state(holder, "work") == "held", 10.0, f"{verb} to hold work")
            pane.line("echo attached:$$")
            match = pane.wait_line(r"^attached:(\d+)$", history=True)
            if shell is None:
                shell = match.group(1)
            assert match.group(1) == shell
            pane.line("clear")
            detach(pane, "work", holder)
        else:  # not a terminal's: its output and exit status are checked where they are
            pane.line("clear")
            pane.wait_prompt(OUTER)
            listed = sh(command, doc_env(holder.socket))
            assert re.search(rf"^{RUN_OWNER}/work\s+draining", listed, re.M), listed
    assert shell is not None


# --- the C client's README ---------------------------------------------------------------


def test_every_test_the_c_clients_table_names_exists() -> None:
    """Each row of client/c/README.md's "What it has" names the tests that show it: a
    name that no longer exists (renamed, removed) would leave a "yes" with nothing behind
    it. `::name` after a `tests/file.py::name` is another test of the same file."""
    readme = (REPO / "client/c/README.md").read_text()
    table = readme.split("## What it has", 1)[1].split("\n## ", 1)[0]
    named: list[tuple[str, str]] = []
    for row in table.splitlines():
        current = ""
        for path, name in re.findall(r"`(tests/[\w/]+\.py)?::(\w+)`", row):
            current = path or current
            assert current, f"{name} names no file: {row}"
            named.append((current, name))
    assert len(named) >= 7, named
    for path, name in named:
        source = (REPO / path).read_text()
        assert re.search(rf"^def {name}\(", source, re.M), f"{path}::{name} does not exist"


def test_the_c_example_compiles_and_takes_a_session_back(
        holder: HolderProcess, workdir: Path) -> None:
    """client/c/README.md: its compile command as written (in a copy of client/c), and its
    example in a program, built with the same flags, that runs it against a holder
    draining `tab-1`: the replay comes out on the screen (stdout here)."""
    require_program("cc")
    readme = REPO / "client/c/README.md"
    [build] = commands(block_with("sh", readme, "cc "))
    source = workdir / "c"
    shutil.copytree(REPO / "client/c", source)
    subprocess.run(["bash", "-c", build.text], cwd=source, check=True, timeout=120)
    objects = sorted(str(o) for o in source.glob("*.o"))
    library = sorted(f"{source}/{c.stem}.o" for c in (REPO / "client/c").glob("escrow*.c")
                     if c.name != "escrow-c.c")  # every file but the test driver
    assert objects == library, objects  # "link the objects into the app"
    example = block_with("c", readme, "escrow_retrieve")
    (source / "example.c").write_text(
        '#include <stdio.h>\n#include <unistd.h>\n#include "escrow.h"\n'
        "static void example(int screen) {\n" + example.text + "}\n"
        "int main(void) { example(STDOUT_FILENO); return 0; }\n")
    flags = build.text.split(" -c ")[0].split()[1:]
    subprocess.run(["cc", *flags, "-o", "example", "example.c", *objects], cwd=source,
                   check=True, timeout=120)

    master, slave = os.openpty()
    child = subprocess.Popen(["sh", "-c", "echo first; read x; echo after-$x; exec sleep 60"],
                             stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
    os.close(slave)
    try:
        seen = b""

        def first() -> bool:
            nonlocal seen
            seen += os.read(master, 4096)
            return b"first" in seen

        wait_for(first, 10.0, "the child's first line")
        os.write(master, b"go\n")  # what it prints now is left for the holder to drain
        holder.client("com.example.term").hand_off("tab-1", master, child_pid=child.pid)
    finally:
        os.close(master)
    try:
        printed = len(b"go\r\nafter-go\r\n")  # the echo of what it read, then its line
        wait_for(lambda: buffered(holder, "tab-1") >= printed, 10.0, "the drain")
        run = subprocess.run([str(source / "example")], env=doc_env(holder.socket),
                             capture_output=True, timeout=20)
        assert run.returncode == 0, run
        assert b"after-go" in run.stdout, run
        assert state_of(holder, "tab-1") == "handed_off"
    finally:
        child.kill()
        child.wait()


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def state_of(holder: HolderProcess, sid: str) -> str:
    info = next((s for s in holder.client("com.example.term").list() if s.id == sid), None)
    return info.state if info is not None else "unknown"


def buffered(holder: HolderProcess, sid: str) -> int:
    info = next((s for s in holder.client("com.example.term").list() if s.id == sid), None)
    return info.buffered_bytes if info is not None else 0
