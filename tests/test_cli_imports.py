"""What `escrowctl` imports for each call: only the parser and the verb it runs.

Every module an `escrowctl status` imports is time before its answer, paid at each call of
a monitor's loop or a prompt's (bench/cli_calls.py measures it). These tests count modules,
never time: each call runs as a user's install runs it (a copy of the package in a virtual
environment of its own, no editable finder, which imports pathlib and urllib into every
start) through pip's console script, and the modules loaded when it exits are checked
against what that call must not need.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from installation import make_installation

import escrow_client
from conftest import HolderProcess, PtyChild
from escrow_client import cli
from escrow_client.parser import build_parser

VERBS = ("status", "stop", "upgrade", "list", "release", "kill", "attach", "run",
         "install_service", "uninstall_service", "demo", "completion", "wait")
# Nothing a call of escrowctl needs but the one verb that uses it.
EVERY_CALL = (
    "trio", "escrowd", "xml", "urllib", "http", "email", "ssl", "subprocess",
    "escrow_client.service_files", "escrow_client.service_removal", "escrow_client.custody",
    "escrow_client.reclaim",
    "escrow_client.retrieve", "escrow_client.resolve", "escrow_client.attach",
    "escrow_client.demo", "escrow_client.control", "escrow_client.autostart",
    "escrow_client.journal", "escrow_client.replies", "escrow_client.completion",
    "escrow_client.kill",
    "escrow_client.program_wait", "escrow_client.run_start",
)
# What only a call to the holder needs.
CALLS = ("socket", "msgspec", "escrow_client.protocol", "escrow_client.channel",
         "escrow_client.liveness", "escrow_client.client", "psutil", "json", "dataclasses",
         "escrow_client.commands.arguments")


def verbs_but(*ran: str) -> tuple[str, ...]:
    return tuple(f"escrow_client.commands.{v}" for v in VERBS if v not in ran)


@pytest.fixture(scope="module")
def escrowctl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A user's install of escrowctl: its console script, as pip writes it."""
    where = tmp_path_factory.mktemp("install") / "venv"
    python = make_installation(where)
    script = where / "bin" / "escrowctl"
    script.write_text(f"#!{python}\nimport sys\nfrom escrow_client.cli import main\n"
                      "if __name__ == '__main__':\n"
                      "    sys.argv[0] = sys.argv[0].removesuffix('.exe')\n"
                      "    sys.exit(main())\n")
    script.chmod(0o755)
    return script


# The console script run as itself (`__main__`), and the modules loaded when it exits
# written to a file. (Not `-X importtime`: it does not see `importlib.import_module`.)
_RUN = """
import atexit, runpy, sys
out, script = sys.argv[1], sys.argv[2]
atexit.register(lambda: open(out, "w").write("\\n".join(sorted(sys.modules))))
sys.argv = sys.argv[2:]
runpy.run_path(script, run_name="__main__")
"""


def imports(escrowctl: Path, *args: str, socket: str = "/nonexistent/escrowd.sock",
            ) -> tuple[set[str], subprocess.CompletedProcess[str]]:
    """The modules `escrowctl ARGS` had loaded when it exited, and how it ended."""
    python = escrowctl.parent / "python"
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["ESCROW_SOCKET"] = socket
    out = escrowctl.parent.parent / f"modules-{os.getpid()}-{len(args)}.txt"
    result = subprocess.run([str(python), "-c", _RUN, str(out), str(escrowctl), *args],
                            capture_output=True, text=True, timeout=60, env=env,
                            stdin=subprocess.DEVNULL, cwd="/")
    names = set(out.read_text().split())
    out.unlink()
    assert "escrow_client.cli" in names, result.stderr
    return names, result


def loaded(names: set[str], denied: tuple[str, ...]) -> list[str]:
    """Those of `denied` (packages with their submodules) among `names`."""
    return sorted(n for n in names if any(n == d or n.startswith(d + ".") for d in denied))


@pytest.mark.parametrize("args", [["--version"], ["--help"], []])
def test_version_and_help_import_no_verb(escrowctl: Path, args: list[str]) -> None:
    names, result = imports(escrowctl, *args)
    assert result.returncode == (2 if not args else 0), result.stderr
    assert "escrow_client.cli" in names
    assert not loaded(names, EVERY_CALL + CALLS + verbs_but()), result.stderr


def test_version_imports_nothing_but_cli(escrowctl: Path) -> None:
    """`--version` first on the line is answered before argparse is imported."""
    names, result = imports(escrowctl, "--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"escrowctl {escrow_client.__version__}\n"
    ours = sorted(n for n in names if n.startswith("escrow_client"))
    # (The three functions that share their module's name come with the package.)
    assert ours == ["escrow_client", "escrow_client.after_replay", "escrow_client.cli",
                    "escrow_client.repaint", "escrow_client.safe_replay"]
    assert not loaded(names, ("argparse", "gettext", "locale", "shutil"))


@pytest.mark.parametrize("args", [
    ["--version"], ["--version", "status"], ["--version", "--bogus"], ["--version", "-h"],
    ["--socket", "/nonexistent/s", "--version"], ["--timeout", "2", "--version"], ["--vers"],
    ["list", "--version"], ["attach", "--version"], ["run", "--version"],
    ["status", "--json", "--version"],
])
def test_version_anywhere_says_the_same(escrowctl: Path, args: list[str],
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """The answer given before argparse is the parser's own, wherever `--version` is."""
    with pytest.raises(SystemExit) as stopped:
        build_parser().parse_args(args)
    assert stopped.value.code == 0
    parsers = capsys.readouterr().out
    assert parsers == f"escrowctl {escrow_client.__version__}\n"
    try:
        status = cli.main(args)
    except SystemExit as exc:  # the parser's own answer: `--version` was not first
        status = exc.code
    assert (status, capsys.readouterr().out) == (0, parsers)
    result = subprocess.run([str(escrowctl), *args], capture_output=True, text=True,
                            timeout=60, stdin=subprocess.DEVNULL, cwd="/")
    assert (result.returncode, result.stdout, result.stderr) == (0, parsers, "")


def make_sessions(holder: HolderProcess, pty_children: Callable[..., PtyChild]) -> None:
    """Three draining sessions: `list` has rows to print, `status` replays to sum."""
    for i in range(3):
        child = pty_children(["sh", "-c", "exec sleep 60"])
        holder.client("com.example.imports").hand_off(f"tab-{i}", child.master,
                                                      child_pid=child.pid, label="sh")
        os.close(child.master)
        child.master = -1


def test_status_imports_only_status(escrowctl: Path, holder: HolderProcess,
                                    pty_children: Callable[..., PtyChild]) -> None:
    make_sessions(holder, pty_children)
    names, result = imports(escrowctl, "status", socket=holder.socket)
    assert result.returncode == 0, result.stderr
    assert "escrowd: running" in result.stdout
    assert "escrow_client.commands.status" in names
    # Whether the pidfile's process is alive is read from /proc, without psutil.
    denied = EVERY_CALL + verbs_but("status") + ("escrow_client.client", "json", "psutil")
    assert not loaded(names, denied)


def test_status_of_no_holder_imports_only_status(escrowctl: Path, tmp_path: Path) -> None:
    names, result = imports(escrowctl, "status", socket=str(tmp_path / "escrowd.sock"))
    assert result.returncode == 3, result.stderr  # not_running
    assert not loaded(names, EVERY_CALL + verbs_but("status") + ("escrow_client.client", "psutil"))


def test_list_imports_only_list(escrowctl: Path, holder: HolderProcess,
                                pty_children: Callable[..., PtyChild]) -> None:
    make_sessions(holder, pty_children)
    names, result = imports(escrowctl, "list", socket=holder.socket)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("com.example.imports/tab-") == 3
    assert "escrow_client.commands.list" in names
    denied = EVERY_CALL + verbs_but("list") + ("psutil", "json")
    assert not loaded(names, denied)


def test_list_of_a_held_session_imports_no_psutil(escrowctl: Path, holder: HolderProcess,
                                                  pty_children: Callable[..., PtyChild]
                                                  ) -> None:
    """A held session's row names its custodian's process, read from /proc."""
    child = pty_children(["sh", "-c", "exec sleep 60"])
    with holder.client("com.example.imports").custody() as custody:
        custody.deposit("held", child.master, child_pid=child.pid, label="sh")
        names, result = imports(escrowctl, "list", socket=holder.socket)
    assert result.returncode == 0, result.stderr
    assert f"held by pid {os.getpid()} (" in result.stdout
    assert not loaded(names, EVERY_CALL + verbs_but("list") + ("psutil", "json"))


def test_a_tabs_question_imports_no_verb_and_no_parser(escrowctl: Path, holder: HolderProcess,
                                                        pty_children: Callable[..., PtyChild]
                                                        ) -> None:
    """`escrowctl _complete sessions`, asked at each Tab, is answered before the parser."""
    make_sessions(holder, pty_children)
    names, result = imports(escrowctl, "_complete", "sessions", "attach", socket=holder.socket)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"com.example.imports/tab-{i}" for i in range(3)]
    assert "escrow_client.completion" in names
    denied = verbs_but() + ("trio", "escrowd", "escrow_client.parser", "escrow_client.attach",
                            "escrow_client.autostart", "psutil")
    assert not loaded(names, denied)


def test_a_verbs_help_imports_that_verb(escrowctl: Path) -> None:
    names, result = imports(escrowctl, "install-service", "--help")
    assert result.returncode == 0, result.stderr
    assert "escrow_client.commands.install_service" in names
    assert not loaded(names, verbs_but("install_service") + ("trio", "escrowd"))


def test_the_library_keeps_its_names(escrowctl: Path) -> None:
    """`from escrow_client import X` gives every name it always has, each from its module."""
    python = escrowctl.parent / "python"
    code = ("import escrow_client as e, escrow_client.client as c, escrow_client.cli as cli; "
            "from escrow_client import *; "
            "assert all(getattr(e, n) is not None for n in e.__all__); "
            "assert set(e.__all__) <= set(dir(e)); "
            "assert e.EscrowClient is c.EscrowClient; assert e.Retrieved is c.Retrieved; "
            "assert e.ReclaimReport is c.ReclaimReport; "
            "assert cli.STATUS_EXIT_CODES['running'] == 0 and cli.STOP_NOT_PERMITTED == 6; "
            "assert 'trio' not in sys.modules; "
            # Importing every module of the package leaves each public name what it was (a
            # module shares its name with the function it exports: safe_replay, repaint).
            "import importlib, pkgutil, types; "
            "[importlib.import_module(f'escrow_client.{m.name}') "
            " for m in pkgutil.iter_modules(e.__path__)]; "
            "bad = [n for n in e.__all__ if isinstance(getattr(e, n), types.ModuleType)]; "
            "assert not bad, bad")
    result = subprocess.run([str(python), "-c", "import sys; " + code], capture_output=True,
                            text=True, timeout=60, cwd="/")
    assert result.returncode == 0, result.stderr
    with pytest.raises(AttributeError):
        __import__("escrow_client").no_such_name  # noqa: B018


if sys.platform != "linux":  # pragma: no cover
    pytestmark = pytest.mark.skip("the installation helper lays out a Linux venv")
