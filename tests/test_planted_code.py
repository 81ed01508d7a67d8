"""The holder runs only its own code, wherever it is started from.

Incident pinned: every holder was started as `python -m escrowd` in whatever directory the
caller was in (the keeper's holder and each restart, the upgrade's `--check`, autostart,
and `escrowctl demo`'s app processes), and `-m` puts the current directory first on
`sys.path`. Another user who could write that directory (/tmp, /var/tmp, a shared project
folder) planted an `escrowd/` package there; after the next holder restart it ran as the
victim, received every stored PTY master and typed into the victim's shell, while
`escrowctl status` said `running`.

Here a real second user plants `escrowd/` and `escrow_client/` packages in a 1777
directory, and the victim (this suite's user) starts the keeper, upgrades, autostarts and
runs the demo from it, with the installed commands as a user types them. The planted code
would leave a mark; none appears, and every holder runs from `/`.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from otheruser import OtherUser, other_user, system_python

from conftest import OWNER, wait_for
from escrow_client import EscrowClient, protocol

BIN = Path(sys.executable).parent
PLANTED = ("escrowd", "escrow_client")


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory like /tmp (mode 1777) into which the other user has planted packages."""
    base = Path(tempfile.mkdtemp(prefix="esc-planted-"))
    os.chmod(base, 0o755)
    directory = base / "shared"
    directory.mkdir()
    os.chmod(directory, 0o1777)
    plant(directory, other_user())
    yield directory
    shutil.rmtree(base, ignore_errors=True)


def plant(directory: Path, user: OtherUser) -> None:
    """As `user`: an `escrowd` and an `escrow_client` package that, imported, leave a file
    named after themselves in `directory` (the victim can write there, it is 1777)."""
    program = textwrap.dedent("""
        import os, sys
        root = sys.argv[1]
        for name in sys.argv[2:]:
            os.mkdir(os.path.join(root, name), 0o755)
            for module in ("__init__", "__main__"):
                with open(os.path.join(root, name, module + ".py"), "w") as f:
                    f.write("import os\\n"
                            f"open(os.path.join({root!r}, 'RAN-{name}'), 'a').close()\\n")
    """)
    subprocess.run([system_python(), "-c", program, str(directory), *PLANTED], check=True,
                   user=user.uid, group=user.gid, extra_groups=[], timeout=30,
                   capture_output=True)
    assert all((directory / name / "__init__.py").stat().st_uid == user.uid for name in PLANTED)


def marks(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("RAN-"))


def private_dir() -> Path:
    d = Path(tempfile.mkdtemp(prefix="esc-victim-"))
    os.chmod(d, 0o700)
    return d


def holders_on(socket_path: str) -> list[int]:
    """The escrowd processes serving `socket_path` (the keeper and its holder)."""
    found = []
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"escrowd" in b" ".join(argv) and os.fsencode(socket_path) in argv:
            found.append(pid)
    return found


def test_a_keeper_started_in_a_shared_directory_runs_only_its_own_code(shared: Path) -> None:
    """The keeper, its holder, a restart after an upgrade (and its trial run), and the demo:
    all from a directory another user planted packages in."""
    victim = private_dir()
    sock = str(victim / "escrowd.sock")
    log = open(victim / "escrowd.log", "wb")
    keeper = subprocess.Popen([str(BIN / "escrowd"), "--socket", sock], cwd=shared,
                              stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    try:
        client = EscrowClient(OWNER, socket_path=sock)
        first = wait_for(lambda: _status(client, shared), 15.0, "the keeper's holder to answer")
        assert first.keeper_pid == keeper.pid
        assert os.readlink(f"/proc/{first.pid}/cwd") == "/"
        assert marks(shared) == [], "the holder ran code planted in its caller's directory"

        # escrowctl upgrade, typed in that directory: the trial run and the new holder.
        upgrade = subprocess.run([str(BIN / "escrowctl"), "--socket", sock, "upgrade"],
                                 cwd=shared, capture_output=True, text=True, timeout=60,
                                 stdin=subprocess.DEVNULL)
        assert marks(shared) == [], "the upgrade ran code planted in its caller's directory"
        assert upgrade.returncode == 0, upgrade.stdout + upgrade.stderr
        second = wait_for(lambda: _status(client, shared, unlike=first.instance), 15.0,
                          "the upgraded holder to answer")
        assert os.readlink(f"/proc/{second.pid}/cwd") == "/"
        assert marks(shared) == [], "the upgrade ran code planted in its caller's directory"

        demo = subprocess.run([str(BIN / "escrowctl"), "--socket", sock, "demo"], cwd=shared,
                              capture_output=True, text=True, timeout=90,
                              stdin=subprocess.DEVNULL)
        assert marks(shared) == [], "the demo ran code planted in its caller's directory"
        assert demo.returncode == 0, demo.stdout + demo.stderr
    finally:
        keeper.terminate()
        keeper.wait(30)
        log.close()
        shutil.rmtree(victim, ignore_errors=True)


def test_a_holder_autostarted_from_a_shared_directory_runs_only_its_own_code(
    shared: Path,
) -> None:
    """An app (a script of its own, run from the shared directory) that autostarts."""
    victim = private_dir()
    sock = str(victim / "escrowd.sock")
    app = victim / "app.py"
    app.write_text(textwrap.dedent(f"""
        from escrow_client import EscrowClient
        status = EscrowClient({OWNER!r}, socket_path={sock!r}, autostart=True).status()
        print(status.pid)
    """))
    try:
        ran = subprocess.run([sys.executable, str(app)], cwd=shared, capture_output=True,
                             text=True, timeout=60, stdin=subprocess.DEVNULL)
        assert marks(shared) == [], (
            f"the autostarted holder ran code planted in the app's directory: {marks(shared)}")
        assert ran.returncode == 0, ran.stdout + ran.stderr
        holder = int(ran.stdout.split()[-1])
        assert os.readlink(f"/proc/{holder}/cwd") == "/"
    finally:
        for pid in holders_on(sock):
            os.kill(pid, signal.SIGTERM)
        wait_for(lambda: not holders_on(sock), 30.0, "the autostarted holder to stop")
        shutil.rmtree(victim, ignore_errors=True)


def _status(client: EscrowClient, shared: Path,
            unlike: str | None = None) -> protocol.HolderStatus | None:
    """The holder's status once one other than `unlike` answers; fails at once if planted
    code ran meanwhile (it would never answer)."""
    assert marks(shared) == [], f"planted code ran as the victim: {marks(shared)}"
    try:
        status = client.status()
    except Exception:
        return None
    return status if status.instance != unlike else None

