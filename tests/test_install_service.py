"""The service files: systemd user units and the LaunchAgent, as `escrowctl install-service`
writes them for the escrowd it belongs to, and as they ship in the source tree.

Incidents pinned: the shipped unit assumed `pip install --user` (which Debian 12 refuses)
and named an escrowd that was not there; the LaunchAgent did not pin the socket path, so
under launchd's own $TMPDIR the agent and the apps could look in different places.
"""

from __future__ import annotations

import configparser
import os
import plistlib
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from conftest import OWNER, HolderProcess, require_program, wait_for
from escrow_client import service_files

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
VENV_ESCROWD = VENV_BIN / "escrowd"
MANAGER_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID",
                "LISTEN_FDNAMES", "ESCROW_SOCKET", "XDG_CONFIG_HOME")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in MANAGER_VARS}
    env.update(extra)
    return env


def read_unit(text: str) -> configparser.RawConfigParser:
    parser = configparser.RawConfigParser(strict=False, delimiters=("=",),
                                          comment_prefixes=("#", ";"))
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(text)
    return parser


def options_of(words: list[str]) -> set[str]:
    return {w.split("=", 1)[0] for w in words if w.startswith("-")}


def escrowd_options() -> set[str]:
    result = subprocess.run([str(VENV_ESCROWD), "--help"], capture_output=True, text=True,
                            timeout=30, env=clean_env())
    assert result.returncode == 0, result.stderr
    return options_of(result.stdout.split())


def _systemd_version(analyze: str) -> int:
    out = subprocess.run([analyze, "--version"], capture_output=True, text=True, timeout=30)
    return int(out.stdout.split()[1])


def install_service(home: Path, *args: str) -> str:
    result = subprocess.run([str(VENV_BIN / "escrowctl"), *args], capture_output=True,
                            text=True, timeout=30, env=clean_env(HOME=str(home)))
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_shipped_files_are_what_install_service_renders() -> None:
    """One source for each text: the files in systemd/ and launchd/ are the renderer's output
    for a pipx install, byte for byte."""
    for path, text in service_files.shipped_files().items():
        assert (ROOT / path).read_text() == text, f"{path} differs from service_files.py"


def test_units_agree_with_each_other_and_the_cli() -> None:
    files = service_files.shipped_files()
    sock = read_unit(files["systemd/escrowd.socket"])
    svc = read_unit(files["systemd/escrowd.service"])
    s = svc["Service"]
    assert s["Type"] == "notify" and s["NotifyAccess"] == "main"
    # Stopping the holder signals escrowd alone, never anything else in its cgroup; a clean
    # stop is not undone by a restart, a crash or a watchdog timeout is.
    assert s["KillMode"] == "process"
    # The escrow outlives the holder: any exit restarts it, and systemd keeps every
    # session's fds meanwhile (room for three a session at the default session limit).
    assert s["Restart"] == "always"
    assert int(s["FileDescriptorStoreMax"]) == 3 * 2048 + 1
    assert s["FileDescriptorStorePreserve"] == "yes"
    assert float(s["WatchdogSec"]) > 0
    argv = shlex.split(s["ExecStart"])
    assert argv[0] == "%h/.local/bin/escrowd"  # where pipx puts it
    assert "--bare" in argv  # systemd keeps the fds: no keeper
    # The holder serves the path systemd listens on: lock, pidfile and clients agree.
    assert argv[argv.index("--socket") + 1] == sock["Socket"]["ListenStream"]
    assert sock["Socket"]["ListenStream"] == "%t/escrowd/escrowd.sock"
    assert sock["Socket"]["SocketMode"] == "0600" and sock["Socket"]["DirectoryMode"] == "0700"
    assert svc["Unit"]["Requires"] == "escrowd.socket"
    # A unit that hits a start limit fails and loses its fd store: there is none.
    assert svc["Unit"]["StartLimitIntervalSec"] == "0"
    assert options_of(argv[1:]) <= escrowd_options()


def test_the_store_is_sized_for_the_session_cap_escrowd_is_given() -> None:
    """Incident pinned: the unit fixed FileDescriptorStoreMax=4224, so a holder run with
    --max-sessions above about 2,112 answered `deposited` for sessions systemd then
    dropped from its full store (saying so only in its journal): lost at the next restart.
    The unit is sized from the arguments, with the holder's own numbers."""
    from escrowd.config import Config
    from escrowd.fdstore import FDS_PER_SESSION

    assert service_files.DEFAULT_MAX_SESSIONS == Config(socket_path="").max_sessions
    assert service_files.FDS_PER_SESSION == FDS_PER_SESSION
    for extra, sessions in (([], 2048), (["--max-sessions", "5000"], 5000),
                            (["--ring-bytes", "1", "--max-sessions=10"], 10)):
        unit = read_unit(service_files.systemd_service(["/bin/escrowd"], extra_args=extra))
        assert int(unit["Service"]["FileDescriptorStoreMax"]) == sessions * FDS_PER_SESSION + 1


def test_install_service_writes_units_that_systemd_accepts(tmp_path: Path) -> None:
    """`escrowctl install-service` writes both units into ~/.config/systemd/user, naming the
    escrowd of this installation (not an assumed ~/.local/bin), with escrowd's own options
    after `--`; `systemd-analyze --user verify` accepts them without a word."""
    analyze = require_program("systemd-analyze")
    home = tmp_path / "home"
    home.mkdir()
    out = install_service(home, "install-service", "--systemd", "--", "--unclaimed-ttl", "0")
    unit_dir = home / ".config" / "systemd" / "user"
    service, socket_unit = unit_dir / "escrowd.service", unit_dir / "escrowd.socket"
    assert f"wrote {service}" in out and f"wrote {socket_unit}" in out
    assert "systemctl --user enable --now escrowd.socket" in out
    argv = shlex.split(read_unit(service.read_text())["Service"]["ExecStart"])
    assert argv == [str(VENV_ESCROWD), "--bare", "--socket", "%t/escrowd/escrowd.sock",
                    "--unclaimed-ttl", "0"]
    assert options_of(argv[1:]) <= escrowd_options()

    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
           "XDG_RUNTIME_DIR": str(runtime), "SYSTEMD_PAGER": "", "LANG": "C.UTF-8"}

    def verify(*units: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([analyze, "--user", "verify", *map(str, units)],
                              capture_output=True, text=True, timeout=60, env=env,
                              cwd=tmp_path)

    result = verify(socket_unit, service)
    print(f"systemd-analyze --user verify: exit {result.returncode}\n"
          f"stdout: {result.stdout!r}\nstderr: {result.stderr!r}")
    assert result.returncode == 0
    # systemd before 254 does not know FileDescriptorStorePreserve= (and ignores it, which
    # is what the unit wants there): that one line is the only complaint allowed.
    complaints = [line for line in (result.stdout + result.stderr).splitlines()
                  if "Unknown key 'FileDescriptorStorePreserve'" not in line]
    if _systemd_version(analyze) >= 254:
        complaints += (result.stdout + result.stderr).splitlines()
    assert complaints == []

    # The check is live: the same run over a unit with a mistake does complain.
    broken = tmp_path / "units"
    broken.mkdir()
    (broken / "escrowd.socket").write_text(socket_unit.read_text())
    (broken / "escrowd.service").write_text(
        service.read_text().replace("KillMode=process", "KillMode=process\nKilMode=x"))
    complaint = verify(broken / "escrowd.socket", broken / "escrowd.service")
    assert "KilMode" in complaint.stdout + complaint.stderr


def test_unit_words_are_literal(tmp_path: Path) -> None:
    """A path with a space, % or $ in it is written so that systemd runs exactly that path
    (% starts a specifier in a unit, $ a variable in ExecStart='s arguments), checked by
    systemd itself; a quote or a backslash, which systemd would read differently, is
    refused with a clear error and nothing is written."""
    analyze = require_program("systemd-analyze")
    odd = tmp_path / "opt 50%" / "$HOME"
    odd.mkdir(parents=True)
    (odd / "escrowd").symlink_to(VENV_ESCROWD)
    home = tmp_path / "home"
    home.mkdir()
    install_service(home, "--socket", "/run/a%b$c/escrowd.sock", "install-service",
                    "--systemd", "--escrowd", str(odd / "escrowd"), "--", "--label$x")
    unit_dir = home / ".config" / "systemd" / "user"
    service = (unit_dir / "escrowd.service").read_text()
    assert "ListenStream=/run/a%%b$c/escrowd.sock" in (unit_dir / "escrowd.socket").read_text()
    argv = shlex.split(read_unit(service)["Service"]["ExecStart"])
    assert argv == [str(odd / "escrowd").replace("%", "%%"), "--bare", "--socket",
                    "/run/a%%b$$c/escrowd.sock", "--label$$x"]
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
           "XDG_RUNTIME_DIR": str(runtime), "SYSTEMD_PAGER": "", "LANG": "C.UTF-8"}
    shown = subprocess.run([analyze, "--user", "verify", str(unit_dir / "escrowd.service")],
                           capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    # verify complains of an unknown option at most (there is no --label): never of a
    # path that is not there, which is what a misread % or $ would give.
    assert "not executable" not in shown.stderr and "No such file" not in shown.stderr, \
        shown.stderr
    for bad in ("/opt/it's/escrowd", "/opt/back\\slash/escrowd"):
        result = subprocess.run([str(VENV_BIN / "escrowctl"), "install-service", "--systemd",
                                 "--escrowd", bad], capture_output=True, text=True,
                                timeout=30, env=clean_env(HOME=str(tmp_path / "other")))
        assert result.returncode == 1 and "cannot carry" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
        assert not (tmp_path / "other").exists()


def test_launchd_agent_as_installed_runs_a_holder_on_its_pinned_socket(
    tmp_path: Path, socket_dir: Path
) -> None:
    """The LaunchAgent `install-service --launchd` writes pins the socket the apps use (from
    --socket, else the default) and names this installation's escrowd; the real CLI, run
    with exactly its ProgramArguments and none of the caller's environment for the socket,
    serves there and stops cleanly on SIGTERM."""
    home = tmp_path / "home"
    home.mkdir()
    directory = socket_dir / "launchd"
    sock = str(directory / "escrowd.sock")
    out = install_service(home, "--socket", sock, "install-service", "--launchd")
    plist_path = home / "Library" / "LaunchAgents" / "com.fd-escrow.escrowd.plist"
    assert f"wrote {plist_path}" in out and "launchctl bootstrap" in out
    with open(plist_path, "rb") as f:
        plist = plistlib.load(f)
    assert plist["Label"] == "com.fd-escrow.escrowd" == plist_path.stem
    assert plist["RunAtLoad"] is True
    assert plist["KeepAlive"] == {"SuccessfulExit": False}  # restart on failure only
    assert plist.get("ProcessType", "Standard") != "Background"  # not throttled
    for key in ("StandardOutPath", "StandardErrorPath"):
        assert plist[key] == str(home / "Library" / "Logs" / "escrowd.log")
    argv = plist["ProgramArguments"]
    assert argv == [str(VENV_ESCROWD), "--socket", sock]
    assert options_of(argv[1:]) <= escrowd_options()

    directory.mkdir(mode=0o700)
    log_path = directory / "escrowd.log"
    env = clean_env()
    env.pop("XDG_RUNTIME_DIR", None)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env)
    holder = HolderProcess(sock, proc, log_path)
    try:
        def ready() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"escrowd exited with {proc.returncode}: {holder.logs()}")
            return " event=ready " in holder.logs()

        wait_for(ready, 15.0, "escrowd started as the agent starts it")
        status = holder.client(OWNER).status()
        assert status.keeper_pid == proc.pid and status.fd_store == "keeper"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
