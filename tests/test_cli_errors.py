"""`escrowctl`'s errors about the socket path: each says what is wrong and what to do next,
and never advises a change to a directory the user does not own (or shares, like /tmp)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

from test_cli import assert_no_traceback, escrowctl

from escrow_client import paths


def test_no_holder_says_how_to_start_one(socket_dir: Path) -> None:
    path = str(socket_dir / "nobody.sock")
    result = escrowctl(path, "list")
    assert result.returncode == 1
    assert f"no holder is listening on {path}" in result.stderr
    assert f"`escrowd --socket {path}`" in result.stderr
    assert "systemctl" not in result.stderr  # not the socket the service's units use
    assert result.stderr.endswith("(unavailable)\n"), result.stderr

    status = escrowctl(path, "status")
    assert status.returncode == 3, status.stdout
    assert f"next      start one with `escrowd --socket {path}`" in status.stdout


def test_the_default_socket_names_the_service(socket_dir: Path) -> None:
    env = {**os.environ, "XDG_RUNTIME_DIR": str(socket_dir)}
    env.pop(paths.SOCKET_ENV, None)
    result = subprocess.run([sys.executable, "-m", "escrow_client.cli", "list"], env=env,
                            capture_output=True, text=True, timeout=20,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 1
    assert f"no holder is listening on {socket_dir}/escrowd/escrowd.sock" in result.stderr
    assert "`systemctl --user start escrowd.socket`" in result.stderr, result.stderr


def test_a_directory_the_holder_would_refuse_is_not_advised_a_start(socket_dir: Path) -> None:
    """Closed to writes by others, so the client talks to it; open to reads, so no
    holder would use it (as /run, or a home, 0755): the answer is another directory,
    never a chmod of this one nor a start that would fail."""
    directory = socket_dir / "d755"
    directory.mkdir()
    os.chmod(directory, 0o755)
    path = str(directory / "escrowd.sock")
    for result in (escrowctl(path, "list"), escrowctl(path, "status")):
        out = result.stdout + result.stderr
        assert "no holder can start there: use a socket path in a directory you own" in out, out
        for wrong in ("chmod", "escrowd --socket", "systemctl", "run` starts one"):
            assert wrong not in out, out


def test_a_home_open_to_the_group_is_not_advised_a_chmod(socket_dir: Path) -> None:
    home = socket_dir / "home"
    home.mkdir()
    os.chmod(home, 0o770)
    env = {**os.environ, "HOME": str(home)}
    result = subprocess.run([sys.executable, "-m", "escrow_client.cli", "--socket",
                             str(home / "escrowd.sock"), "list"], env=env,
                            capture_output=True, text=True, timeout=20,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 1
    assert "has mode 0770" in result.stderr and "chmod" not in result.stderr, result.stderr
    assert "it is a shared directory: use a socket path" in result.stderr


def test_a_directory_as_the_socket_names_the_socket_inside(socket_dir: Path) -> None:
    result = escrowctl(str(socket_dir), "list")
    assert result.returncode == 1
    assert result.stderr == (f"escrowctl: {socket_dir} is a directory, not a socket: give "
                             f"the socket's own path, such as {socket_dir}/escrowd.sock "
                             "(config)\n")


def test_a_shared_directory_as_the_socket_never_advises_a_chmod() -> None:
    """/tmp itself (ours as root, the system's otherwise) named as the socket."""
    result = escrowctl(paths.SHARED_TMP, "list")
    assert result.returncode == 1
    assert "chmod" not in result.stderr
    assert f"{paths.SHARED_TMP} is a directory, not a socket" in result.stderr
    assert f"such as the default {paths.standard_socket_path()}" in result.stderr


def test_a_socket_path_in_tmp_points_to_a_directory_of_ones_own() -> None:
    """`ESCROW_SOCKET=/tmp/nope.sock`: /tmp is open to everyone; the answer is a directory
    of the user's own, never `chmod go-w /tmp`."""
    path = f"/tmp/nope-{uuid.uuid4().hex[:8]}.sock"
    env = {**os.environ, paths.SOCKET_ENV: path}
    env.pop("XDG_RUNTIME_DIR", None)
    result = subprocess.run([sys.executable, "-m", "escrow_client.cli", "list"], env=env,
                            capture_output=True, text=True, timeout=20,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 1
    assert_no_traceback(result)
    assert "chmod" not in result.stderr, result.stderr
    assert "refusing to talk to it" in result.stderr
    standard = os.path.join(paths.SHARED_TMP, f"escrowd-{os.getuid()}", "escrowd.sock")
    assert f"such as the default {standard} (drop --socket and $ESCROW_SOCKET)" \
        in result.stderr, result.stderr
    assert result.stderr.endswith("(forbidden)\n")


def test_our_own_group_writable_directory_is_advised_chmod(socket_dir: Path) -> None:
    shared = socket_dir / "shared"
    shared.mkdir()
    os.chmod(shared, 0o770)
    result = escrowctl(str(shared / "escrowd.sock"), "list")
    assert result.returncode == 1
    assert "has mode 0770" in result.stderr
    assert f"if that directory is yours alone, `chmod go-w {shared}`" in result.stderr


def test_a_regular_file_as_the_socket_is_not_a_socket_only(socket_dir: Path) -> None:
    """Not "not a socket" and "refuses connections" at once: the file is the whole story."""
    path = socket_dir / "file"
    path.write_text("not a socket\n")
    listed = escrowctl(str(path), "list")
    assert listed.returncode == 1
    assert listed.stderr.startswith(f"escrowctl: {path} is a regular file, not the socket "
                                    "of a holder"), listed.stderr
    assert listed.stderr.endswith("(config)\n")

    status = escrowctl(str(path), "status")
    assert status.returncode == 4
    assert "refuses" not in status.stdout, status.stdout
    assert f"{path} is a regular file, not the socket of a holder" in status.stdout
    assert "socket    not a socket: nothing can listen there" in status.stdout
    assert path.read_text() == "not a socket\n"  # nothing touched
