"""The project as a user installs it: with pipx (the README's command), and the editable
.venv.

The install test is the slow one in the suite (about 20-40 s, most of it `python -m build`
and `pipx install`; the first run on a machine also downloads the build backend and the
dependencies from PyPI). It still runs in the normal suite: a packaging mistake (a module
left out of the wheel, a console script pointing nowhere, trio leaking into the client)
would otherwise only show up on a user's machine.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

from conftest import wait_for

REPO = Path(__file__).resolve().parent.parent
NO_TRIO = (
    "import sys, escrow_client; import escrow_client.client, escrow_client.cli; "
    "assert 'trio' not in sys.modules, 'escrow_client imported trio'"
)
# What a build must not see: local state that could leak stale files into the wheel.
_NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis",
    ".typecheck",
)


def run(argv: list[str | Path], cwd: Path, timeout: float = 120.0,
        env: dict[str, str] | None = None) -> str:
    """Run `argv` in `cwd` (never the repo, so the source tree is not on sys.path)."""
    result = subprocess.run(
        [str(a) for a in argv], cwd=cwd, capture_output=True, text=True, timeout=timeout,
        stdin=subprocess.DEVNULL, env={**_clean_env(), **(env or {})},
    )
    assert result.returncode == 0, (
        f"{argv} exited {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    )
    return result.stdout


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "ESCROW_SOCKET")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pipx_install_as_the_readme_says(tmp_path: Path) -> None:
    """Incident pinned: the README said `pip install --user .`, which Debian 12 refuses
    (an externally managed environment). The recommended `pipx install .` gives a working
    escrowd and escrowctl: `escrowctl status` says running, and the demo runs."""
    # Build from a copy of the source, so stale files in an old build/ cannot slip in.
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=_NOT_SOURCE)
    dist = tmp_path / "dist"
    run([sys.executable, "-m", "build", "--wheel", "--outdir", dist, src], cwd=tmp_path)
    [wheel] = dist.glob("fd_escrow-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in ("escrow_client/__init__.py", "escrow_client/cli.py", "escrow_client/demo.py",
                   "escrow_client/protocol.py", "escrow_client/py.typed",
                   "escrowd/__main__.py", "escrowd/py.typed"):
        assert module in names, f"{module} is missing from {wheel.name}"
    assert not [n for n in names if n.startswith(("client/", "tests/", "bench/"))]
    for page in ("escrowctl.1", "escrowd.1"):  # the man pages, as the wheel's data
        assert f"fd_escrow-0.1.0.data/data/share/man/man1/{page}" in names, sorted(names)

    # Installed as the README says (pipx: Debian 12 refuses `pip install --user`), into a
    # pipx home of its own, from the same source.
    pipx_env = {"PIPX_HOME": str(tmp_path / "pipx"), "PIPX_BIN_DIR": str(tmp_path / "bin"),
                "PIPX_MAN_DIR": str(tmp_path / "man")}
    run([Path(sys.executable).parent / "pipx", "install", src], cwd=tmp_path, env=pipx_env)
    env_dir = tmp_path / "pipx" / "venvs" / "fd-escrow"
    python, bin_dir = env_dir / "bin" / "python", tmp_path / "bin"
    assert (bin_dir / "escrowd").exists() and (bin_dir / "escrowctl").exists()
    # pipx links the pages into its man directory ($PIPX_MAN_DIR, by default
    # ~/.local/share/man, beside ~/.local/bin), and `man` finds them from PATH alone.
    for page in ("escrowctl.1", "escrowd.1"):
        assert (tmp_path / "man" / "man1" / page).exists(), page
    if shutil.which("man"):
        man_env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "MANPATH": ""}
        found = run(["man", "-w", "escrowctl"], cwd=tmp_path, env=man_env)
        # (by the console script's link into the venv, whose page pipx's link names)
        linked = (tmp_path / "man" / "man1" / "escrowctl.1").resolve()
        assert Path(found.strip()).resolve() == linked, found

    where = run([python, "-c", "import escrowd, escrow_client; "
                 "print(escrowd.__file__); print(escrow_client.__file__)"], cwd=tmp_path)
    for path in where.splitlines():
        assert Path(path).is_relative_to(env_dir), f"imported {path}, not the installed copy"
    run([python, "-c", NO_TRIO], cwd=tmp_path)
    assert "usage: escrowd" in run([bin_dir / "escrowd", "--help"], cwd=tmp_path)
    assert "usage: escrowctl" in run([bin_dir / "escrowctl", "--help"], cwd=tmp_path)

    # The installed pair works together: its holder, its escrowctl, and the demo's
    # `python -m escrow_client.demo` processes, all from the pipx install.
    # A short directory: tmp_path is too long for a Unix socket path (108 bytes).
    sock_dir = Path(tempfile.mkdtemp(prefix="esc-pkg-"))
    try:
        sock = sock_dir / "escrowd.sock"
        log = sock_dir / "escrowd.log"
        with open(log, "wb") as out:
            holder = subprocess.Popen([bin_dir / "escrowd", "--socket", sock], cwd=tmp_path,
                                      stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                      env=_clean_env())
        try:
            wait_for(lambda: " event=ready " in log.read_text(), 15.0, "installed escrowd")
            assert "escrowd: running" in run([bin_dir / "escrowctl", "--socket", sock,
                                               "status"], cwd=tmp_path)
            demo = run([bin_dir / "escrowctl", "--socket", sock, "demo"], cwd=tmp_path,
                       timeout=30)
            assert "(same process)" in demo
        finally:
            holder.send_signal(signal.SIGTERM)
            holder.wait(10)
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)


def test_dev_venv_is_an_editable_install(tmp_path: Path) -> None:
    python = REPO / ".venv" / "bin" / "python"
    assert python.exists(), "scripts/setup creates .venv"
    where = run([python, "-c", "import escrowd, escrow_client; "
                 "print(escrowd.__file__); print(escrow_client.__file__)"], cwd=tmp_path)
    escrowd_file, client_file = map(Path, where.splitlines())
    assert escrowd_file.resolve().is_relative_to(REPO / "escrowd")
    assert client_file.resolve().is_relative_to(REPO / "client"), (
        f"escrow_client comes from {client_file}, not from the repo's client/ directory"
    )
    run([python, "-c", NO_TRIO], cwd=tmp_path)
