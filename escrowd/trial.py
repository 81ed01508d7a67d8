"""An upgrade's trial run, for the keeper (docs/design.md §11): `escrowctl upgrade` (SIGHUP)
tries the installed code first (`escrowd --check`, from `/`, isolated like every child:
escrow_client.interpreter), beside the keeper's loop, which keeps reading its holder's
notifications meanwhile; only if it starts is the holder (and its standby) replaced.
"""

from __future__ import annotations

import subprocess

from escrow_client.interpreter import CHILD_CWD, python_command

from .log import log


class TrialRun:
    """At most one trial run at a time. Resource handling: owns the process until
    `passed` has read it."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        return self.proc is not None

    def start(self) -> None:
        if self.proc is None:
            self.proc = subprocess.Popen(
                python_command("escrowd", "--check"), stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=CHILD_CWD)

    def passed(self) -> bool | None:
        """None while none has finished; else whether the installed code started, logged:
        `upgrade` with its version, or `upgrade_refused` with why not."""
        check = self.proc
        if check is None or check.poll() is None:
            return None
        self.proc = None
        out, err = check.communicate()
        if check.returncode != 0:
            log("upgrade_refused", reason="the installed escrowd does not start: "
                + err.decode(errors="replace").strip()[-300:])
            return False
        log("upgrade", version=out.decode(errors="replace").strip())
        return True
