"""What the tests on a real screen share (test_attach.py, test_repaint.py): a private tmux
server's commands, a pane polled until it shows what a test waits for, and processes known
to be gone."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from typing import TypeVar

import psutil

from conftest import wait_for

T = TypeVar("T")


def run_tmux(socket: str, env: dict[str, str], *args: str) -> str:
    """A command to the tmux server on `socket` (no config file): its output."""
    return subprocess.run(
        ["tmux", "-S", socket, "-f", "/dev/null", *args], env=env, check=True,
        capture_output=True, text=True, timeout=10,
    ).stdout


def wait_for_screen(capture: Callable[[], str], check: Callable[[str], T], what: str,
                    timeout: float, pane: str = "the pane") -> str:
    """The screen `capture` gives, once `check` accepts it; else an AssertionError that
    shows the last screen."""
    screens = [""]

    def shown() -> T:
        screens[0] = capture()
        return check(screens[0])

    try:
        wait_for(shown, timeout, what)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; {pane} shows:\n{screens[0]}") from None
    return screens[0]


def gone(proc: psutil.Process) -> bool:
    try:
        return bool(proc.status() == psutil.STATUS_ZOMBIE)  # nobody here may reap an orphan
    except psutil.NoSuchProcess:
        return True
