"""A real `systemd --user` manager (and a journald) for the tests, on machines that do not
boot with systemd (these VMs, CI).

`started()` runs `/lib/systemd/systemd --user` as root (uid 0: the project's virtualenv may
live under /root, mode 0700, where no other uid could run it) with:

- a private mount namespace (`unshare -m`) holding a tmpfs on /run/systemd with
  /run/systemd/system in it, which is what sd_booted() looks for;
- cgroups of its own, on every cgroup hierarchy systemd uses here (the named `systemd` v1
  hierarchy and the unified one on a hybrid host, the one tree on a cgroup2 host):
  `fd-escrow-test-<unique>.slice/user@0.service`, a slice of its own so that the managers of
  concurrent runs never meet, and named as a user manager so that the journal attributes
  each message to its user unit (`_SYSTEMD_USER_UNIT=`);
- its own $XDG_RUNTIME_DIR and $HOME (temporary directories), so its units, its sockets and
  `%t`/`%h` are the test's own;
- a systemd-journald of its own in the same namespace (volatile: a tmpfs on /run/log, and
  on /var/log/journal if the host has one, so the host's journal is never touched), which
  receives the manager's log at debug level (every fd stored, every job) and every
  service's output.

Commands reach the manager as a user's shell would, inside its mount namespace (`nsenter
-m`) with its environment: `UserManager.run()`, `.systemctl()`, `.show()`, `.journal()`.
(`journalctl --user` finds nothing for uid 0, whose messages journald keeps in the system
journal: `.journal()` runs `journalctl --user-unit=...`, which matches the same entries.)

On leaving, every process in the slice (the manager first, so that it restarts nothing) is
SIGKILLed and the cgroups removed; the namespace goes with its last process. If the manager
cannot start, AssertionError carries its output and journal: a failure, never a skip.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from conftest import require_program, require_real, wait_for

SYSTEMD_DIRS = ("/lib/systemd", "/usr/lib/systemd")
CGROUP_ROOT = Path("/sys/fs/cgroup")
START_TIMEOUT = 15.0
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# The journal of the test's namespace: in memory, without the host's kernel log, never
# forwarded, never rate-limited (a test reads every line it looks for).
_JOURNALD_CONF = """\
[Journal]
Storage=volatile
ReadKMsg=no
ForwardToSyslog=no
ForwardToKMsg=no
ForwardToConsole=no
ForwardToWall=no
RateLimitIntervalSec=0
"""

# What the manager logs at debug level about every systemctl call: left out of failures.
_BUS_CHATTER = re.compile(r"private-bus-connection|bus object implementation|private connection"
                          r"|Got message type=|Sent message type=|Bus n/a:|sd-bus:")

# Runs in the new mount namespace: starts journald, then becomes the manager itself (so the
# Popen's pid is the manager's). $1: the systemd directory, $2: the runtime dir, $3: home,
# $4: journald.conf's text, $5...: the slices, one per cgroup hierarchy.
_INNER = r"""
set -eu
lib=$1 runtime=$2 home=$3 conf=$4; shift 4
mount -t tmpfs -o mode=0755 tmpfs /run/systemd
mkdir -p /run/systemd/system /run/systemd/journald.conf.d /run/log
printf '%s' "$conf" > /run/systemd/journald.conf.d/fd-escrow-test.conf
mount -t tmpfs -o mode=0755 tmpfs /run/log
if [ -d /var/log/journal ]; then mount -t tmpfs -o mode=2755 tmpfs /var/log/journal; fi
sh -c 'for s; do echo $$ > "$s/journald.scope/cgroup.procs"; done
       exec "$0/systemd-journald"' "$lib" "$@" &
i=0
until [ -S /run/systemd/journal/stdout ] && [ -S /run/systemd/journal/socket ]; do
    i=$((i + 1)); [ $i -le 200 ] || { echo "systemd-journald did not start" >&2; exit 77; }
    sleep 0.05
done
for s; do echo $$ > "$s/user@0.service/cgroup.procs"; done
exec env -i HOME="$home" USER=root LOGNAME=root XDG_RUNTIME_DIR="$runtime" PATH="$PATH" \
    LANG=C.UTF-8 "$lib/systemd" --user --log-level=debug --log-target=journal
"""


def systemd_version() -> int:
    out = subprocess.run([require_program("systemctl"), "--version"], capture_output=True,
                         text=True, timeout=30, check=True).stdout
    return int(out.split()[1])


@dataclass
class UserManager:
    proc: subprocess.Popen[bytes]
    runtime_dir: Path  # its $XDG_RUNTIME_DIR: %t in its units
    home: Path  # its $HOME: %h, and ~/.config/systemd/user
    output_path: Path  # the manager's (and journald's) own stdout and stderr
    slices: list[Path]  # one per cgroup hierarchy: the manager's and journald's cgroups

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def unit_dir(self) -> Path:
        return self.home / ".config" / "systemd" / "user"

    def env(self) -> dict[str, str]:
        """The environment of a shell of this user: what systemctl --user needs."""
        return {"HOME": str(self.home), "XDG_RUNTIME_DIR": str(self.runtime_dir),
                "PATH": PATH, "LANG": "C.UTF-8", "SYSTEMD_PAGER": "", "SYSTEMD_COLORS": "0"}

    def run(self, *argv: str, check: bool = True,
            timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        """Run `argv` in the manager's mount namespace, with a user shell's environment."""
        command = ["nsenter", "-t", str(self.pid), "-m", "--", "env", "-i",
                   *(f"{k}={v}" for k, v in self.env().items()), *argv]
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                                stdin=subprocess.DEVNULL)
        if check and result.returncode != 0:
            raise AssertionError(
                f"{shlex.join(argv)}: exit {result.returncode}\nstdout: {result.stdout}\n"
                f"stderr: {result.stderr}\n{self.describe()}")
        return result

    def systemctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run("systemctl", "--user", *args, check=check)

    def show(self, unit: str, *properties: str) -> dict[str, str]:
        out = self.systemctl("show", unit, "-p", ",".join(properties)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def main_pid(self, unit: str) -> int:
        return int(self.show(unit, "MainPID")["MainPID"])

    def journal(self, *args: str) -> str:
        """`journalctl` in the manager's namespace, e.g. journal("--user-unit=x.service"):
        the manager's messages about the unit and the unit's own output."""
        return self.run("journalctl", "--no-pager", "-q", "-o", "short-monotonic", *args,
                        check=False).stdout

    def unit_journal(self, unit: str) -> str:
        return self.journal(f"--user-unit={unit}")

    def processes(self) -> list[int]:
        """Every process in the test's slice: the manager, journald and every unit."""
        pids: set[int] = set()
        for top in self.slices:
            for procs in top.rglob("cgroup.procs"):
                with contextlib.suppress(OSError):
                    pids.update(int(p) for p in procs.read_text().split())
        return sorted(pids)

    def describe(self) -> str:
        """The manager's output and the tail of the journal, for a failure message."""
        output = self.output_path.read_text(errors="replace")[-4000:]
        journal = ""
        if self.proc.poll() is None:
            lines = self.run("journalctl", "--no-pager", "-q", check=False,
                             timeout=10).stdout.splitlines()
            journal = "\n".join([line for line in lines if not _BUS_CHATTER.search(line)][-120:])
        return f"--- manager output ---\n{output}\n--- journal (tail) ---\n{journal}"


def _cgroup_hierarchies() -> list[Path]:
    """Where a systemd manager keeps its cgroups: the unified tree on a cgroup2 host; the
    named `systemd` hierarchy and the unified one (if mounted) on a hybrid or legacy one."""
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        return [CGROUP_ROOT]
    return [CGROUP_ROOT / name for name in ("systemd", "unified")
            if (CGROUP_ROOT / name / "cgroup.procs").exists()]


def _systemd_dir() -> str:
    found = next((d for d in SYSTEMD_DIRS if os.access(f"{d}/systemd", os.X_OK)
                  and os.access(f"{d}/systemd-journald", os.X_OK)), None)
    require_real("systemd (the manager and journald)", found is not None,
                 "run scripts/setup --test, which installs it")
    assert found is not None
    return found


@contextlib.contextmanager
def started() -> Iterator[UserManager]:
    """A running `systemd --user` (see the module's docstring), stopped with everything in
    it on leaving."""
    require_real("root (to run a user manager in a namespace of its own)", os.geteuid() == 0,
                 "run the suite as root, as CI does")
    for program in ("systemctl", "journalctl", "nsenter", "unshare", "mount"):
        require_program(program)
    lib = _systemd_dir()
    hierarchies = _cgroup_hierarchies()
    if not hierarchies:
        raise AssertionError(f"no cgroup hierarchy for systemd under {CGROUP_ROOT}: "
                             "a user manager cannot run here")
    # Short: the holder's socket lives under the runtime dir (108 bytes at most).
    runtime = Path(tempfile.mkdtemp(prefix="esc-sd-"))
    home = Path(tempfile.mkdtemp(prefix="esc-sd-home-"))
    os.chmod(runtime, 0o700)
    output_path = home / "manager.out"
    name = f"fd-escrow-test-{os.getpid()}-{uuid.uuid4().hex[:8]}.slice"
    slices = [h / name for h in hierarchies]
    manager: UserManager | None = None
    try:
        for top in slices:
            try:
                (top / "user@0.service").mkdir(parents=True)
                (top / "journald.scope").mkdir()
            except OSError as exc:
                raise AssertionError(f"cannot make a cgroup for the user manager ({exc}): "
                                     "it cannot run here") from None
        with open(output_path, "wb") as output:
            proc = subprocess.Popen(
                ["unshare", "-m", "--propagation", "private", "sh", "-c", _INNER, "inner", lib,
                 str(runtime), str(home), _JOURNALD_CONF, *map(str, slices)],
                stdin=subprocess.DEVNULL, stdout=output, stderr=output,
                start_new_session=True)
        manager = UserManager(proc, runtime, home, output_path, slices)
        _wait_running(manager)
        yield manager
    finally:
        if manager is not None:
            _stop(manager)
        _remove_cgroups(slices)
        shutil.rmtree(runtime, ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)


def _wait_running(manager: UserManager) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        if manager.proc.poll() is not None:
            raise AssertionError(f"systemd --user exited with {manager.proc.returncode} "
                                 f"before it ran:\n{manager.describe()}")
        result = manager.run("systemctl", "--user", "is-system-running", check=False)
        state = result.stdout.strip()
        if state in ("running", "degraded"):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"systemd --user did not come up within {START_TIMEOUT}s "
                                 f"(is-system-running: {state!r} {result.stderr.strip()!r})"
                                 f":\n{manager.describe()}")
        time.sleep(0.05)


def _stop(manager: UserManager) -> None:
    """SIGKILL the manager (so that it restarts nothing), then everything left in the
    slice, until it is empty."""
    if manager.proc.poll() is None:
        manager.proc.kill()
    manager.proc.wait()

    def empty() -> bool:
        pids = manager.processes()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return not pids

    wait_for(empty, 10.0, "every process of the user manager gone")


def _remove_cgroups(slices: list[Path]) -> None:
    for top in slices:
        if not top.exists():
            continue
        below = sorted((p for p in top.rglob("*") if p.is_dir()),
                       key=lambda p: len(p.parts), reverse=True)
        for cgroup in [*below, top]:
            wait_for(lambda cgroup=cgroup: _rmdir(cgroup), 5.0, f"cgroup {cgroup} removed")


def _rmdir(path: Path) -> bool:
    try:
        path.rmdir()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True
