"""The two halves of `escrowctl demo`: an app before its relaunch, and the app after it.

`escrowctl demo` runs each half as its own process, so the relaunch is a real one:

- `python -m escrow_client.demo app`: starts a shell in a new PTY printing a counter, shows
  a few ticks, deposits the PTY master with escrowd under custody, and exits. Its exit ends
  custody, as a crash would, and escrowd starts draining the terminal.
- `python -m escrow_client.demo reclaim`: a fresh process retrieves the session into its
  own custody (it stays escrowed), prints the replay (the ticks nobody was reading),
  repaints, reads a few live ticks from the same terminal, shows that the shell is the same
  process, then ends the shell and releases the session.

The shell prints its own pid in every tick, so "the same process" is read off the terminal,
not taken on trust.

`escrowctl demo` (escrow_client.commands.demo) sets the scene around the two: it runs each
half (`run_half`), reads what the first half reports about its shell (`read_report`), and
whatever failed, leaves nothing behind (`leave_nothing`).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Sequence
from typing import Any

from . import errors
from .client import DEFAULT_TIMEOUT, EscrowClient, Retrieved
from .custody import Custody
from .interpreter import CHILD_CWD, python_command
from .liveness import process_alive, process_start_time
from .protocol import LIVE_STATES, Welcome

OWNER = "com.example.escrowctl-demo"
PAUSE = 1.5  # how long escrowctl leaves the session with escrowd alone
APP_TICKS = 4  # ticks the first app shows before it hands off
LIVE_TICKS = 3  # ticks the second app reads live after taking the terminal back
SHELL = 'i=0; while :; do i=$((i+1)); echo "tick $i from pid $$"; sleep 0.25; done'
COLS, ROWS = 80, 24
TICK_RE = re.compile(r"tick (\d+) from pid (\d+)")


def say(text: str) -> None:
    print(text, flush=True)


class Lines:
    """Split terminal output into lines (dropping the `\\r` the terminal adds)."""

    def __init__(self) -> None:
        self.partial = b""

    def feed(self, data: bytes | memoryview) -> list[str]:
        *complete, self.partial = (self.partial + data).split(b"\n")
        return [line.rstrip(b"\r").decode("utf-8", "replace") for line in complete]


def read_some(fd: int, timeout: float) -> bytes | None:
    """What `fd` has within `timeout` (b"" if nothing), or None once the terminal hung up."""
    ready, _, _ = select.select([fd], [], [], max(0.0, timeout))
    if not ready:
        return b""
    try:
        return os.read(fd, 65536) or None
    except OSError:
        return None  # EIO: the last slave fd is closed


def show(lines: Sequence[str], prefix: str) -> list[tuple[int, int]]:
    """Print `lines` under `prefix`; return the ticks among them as (number, shell pid)."""
    ticks = []
    for line in lines:
        say(f"{prefix}{line}")
        if m := TICK_RE.search(line):
            ticks.append((int(m[1]), int(m[2])))
    return ticks


def read_ticks(fd: int, lines: Lines, count: int, prefix: str,
               timeout: float = 10.0) -> list[tuple[int, int]]:
    """Read and print lines from `fd` until `count` ticks have been seen, the terminal
    hangs up, or `timeout` passes; return the ticks."""
    ticks: list[tuple[int, int]] = []
    deadline = time.monotonic() + timeout
    while len(ticks) < count:
        data = read_some(fd, deadline - time.monotonic())
        if not data:
            break  # timed out, or hung up
        ticks += show(lines.feed(data), prefix)
    return ticks


def spawn_shell() -> tuple[int, subprocess.Popen[bytes], str]:
    """A shell printing a counter, as the session leader of a new PTY whose slave is its
    controlling terminal (as under a real terminal app). Returns (master, process, tty)."""
    master, slave = os.openpty()
    try:
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLS, 0, 0))
        tty = os.ttyname(slave)
        proc = subprocess.Popen(
            ["/bin/sh", "-c", SHELL], stdin=slave, stdout=slave, stderr=slave,
            start_new_session=True, preexec_fn=_take_controlling_tty, close_fds=True,
        )
    except BaseException:
        os.close(master)
        raise
    finally:
        os.close(slave)
    return master, proc, tty


def _take_controlling_tty() -> None:
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def end_shell(pid: int, start_time: float | None, wait: float = 3.0) -> bool:
    """End the demo shell and its children (its process group) if `pid` is still that very
    process; wait until it is gone. Returns True if there was something to end."""
    if process_alive(pid, start_time) is not True:
        return False
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            if os.getpgid(pid) == pid:
                os.killpg(pid, sig)
            else:
                os.kill(pid, sig)
        except ProcessLookupError:
            return True
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if process_alive(pid, start_time) is not True:
                return True
            time.sleep(0.02)
    return True


def _write_report(path: str, **fields: object) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(fields, f)


def read_report(path: str) -> dict[str, Any]:
    """What the app half wrote about its shell (`shell_pid`, `shell_start_time`,
    `last_tick`), or {} if it wrote nothing readable."""
    try:
        with open(path, encoding="utf-8") as f:
            report: dict[str, Any] = json.load(f)
    except (OSError, ValueError):
        return {}
    return report


# --- the app before its relaunch --------------------------------------------------------


def run_app(args: argparse.Namespace) -> int:
    client = EscrowClient(OWNER, socket_path=args.socket, timeout=args.timeout,
                          client_name=f"escrowctl demo app pid={os.getpid()}")
    master, proc, tty = spawn_shell()
    start_time = process_start_time(proc.pid)
    # Written at once, so escrowctl can end the shell even if this process fails later.
    _write_report(args.report, shell_pid=proc.pid, shell_start_time=start_time, last_tick=0)
    say(f"   app (pid {os.getpid()}): shell pid {proc.pid} runs on {tty}; the app reads it:")
    lines = Lines()
    ticks = read_ticks(master, lines, APP_TICKS, "   app | ")
    if len(ticks) < APP_TICKS:
        say(f"   app: the shell printed {len(ticks)} ticks, not {APP_TICKS}; giving up")
        return 1
    last_tick = ticks[-1][0]
    _write_report(args.report, shell_pid=proc.pid, shell_start_time=start_time,
                  last_tick=last_tick)

    say("")
    say("2. The app deposits the terminal with escrowd, then exits (as on an update or a crash).")
    custody = client.custody()
    custody.deposit(args.id, master, child_pid=proc.pid, label="demo shell", cols=COLS,
                    rows=ROWS)
    say(f"   app: deposited {OWNER}/{args.id} with escrowd")
    say("        (escrowd keeps a copy of the terminal, but the app is still its reader)")
    say(f"   app: app exiting with pid {os.getpid()}; with it go its copy of the terminal")
    say("        and its connection to escrowd, so escrowd starts draining the shell")
    # No close(), no release: the process just ends, as a crash would. Custody ends with it.
    return 0


# --- the app after its relaunch ---------------------------------------------------------


def _retrieve(client: EscrowClient, custody: Custody, sid: str) -> Retrieved:
    """Retrieve into custody, retrying while the old app still holds it (it may still be
    exiting)."""
    deadline = time.monotonic() + client.timeout
    while True:
        try:
            return custody.retrieve(sid)
        except (errors.CustodyHeld, errors.Busy):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def run_reclaim(args: argparse.Namespace) -> int:
    client = EscrowClient(OWNER, socket_path=args.socket, timeout=args.timeout,
                          client_name=f"escrowctl demo reclaim pid={os.getpid()}")
    with client.custody() as custody:
        got = _retrieve(client, custody, args.id)
        try:
            same, ok = _show_reclaimed(got, args)
            say("   new app: the demo is over, so it ends the shell and closes the terminal")
            if same:  # the live ticks prove args.shell_pid is still our shell
                end_shell(args.shell_pid, process_start_time(args.shell_pid))
            custody.release(args.id)
        finally:
            os.close(got.fd)
    left = [s for s in client.list() if s.id == args.id]
    state = left[0].state if left else "unknown"
    if state in LIVE_STATES:
        say(f"   escrowd: {args.id} is still {state} there")
        return 1
    say(f"   escrowd: {args.id} is now {state}; escrowd holds nothing from this demo")
    return 0 if ok else 1


def _show_reclaimed(got: Retrieved, args: argparse.Namespace) -> tuple[bool, bool]:
    """Show the replay and a few live ticks. Returns (the shell is the same process, that
    and no tick went missing either)."""
    confirmed = "confirmed by escrowd" if got.confirmed else "not confirmed, but it is ours"
    say(f"   new app (pid {os.getpid()}): took back {OWNER}/{args.id} ({confirmed}),")
    say("   into its custody: still escrowed, so a crash of this app would lose nothing")
    dropped = f" ({got.dropped_bytes} older bytes dropped)" if got.dropped_bytes else ""
    say(f"   escrowd hands over the {len(got.replay)} bytes the shell wrote while no app was "
        f"reading{dropped}:")
    lines = Lines()
    replayed = show(lines.feed(got.replay), "   replay | ")
    got.repaint()
    say("   then it repaints (vim or top would draw their screen again) and reads the same")
    say("   terminal, live:")
    live = read_ticks(got.fd, lines, LIVE_TICKS, "   live   | ")

    say("")
    before = args.shell_pid
    after = live[-1][1] if live else None
    same = after == before
    say(f"5. shell pid before: {before}, after: {after if after is not None else '?'} "
        f"({'same process' if same else 'NOT the same process'})")
    numbers = [args.last_tick] + [n for n, _ in replayed + live]
    lost = [n for a, b in zip(numbers, numbers[1:], strict=False) for n in range(a + 1, b)]
    if lost:
        say(f"   ticks missing: {', '.join(map(str, lost))}")
    elif replayed and live:
        say(f"   and no output lost: the old app saw ticks 1-{args.last_tick}, the replay has "
            f"{replayed[0][0]}-{replayed[-1][0]}, and live goes on at {live[0][0]}")
    return same, same and bool(replayed) and not lost


# --- the scene around the two halves ----------------------------------------------------


def check_timeout(welcome: Welcome, timeout: float) -> None:
    """EscrowConfigError unless `timeout` leaves the reclaim half time to take its session
    back: the holder may take its drain_stop_budget + send_deadline to hand it over."""
    needs = welcome.drain_stop_budget + welcome.send_deadline
    if timeout <= needs:
        raise errors.EscrowConfigError(
            f"--timeout {timeout:g} must exceed the holder's drain_stop_budget + "
            f"send_deadline ({needs:g}s) for the demo to take its session back")


def run_half(role: str, argv: list[str]) -> int:
    """Run one half (`app` or `reclaim`) as a process of its own, on this terminal, for at
    most 60 s; its exit status (1 if it had to be stopped)."""
    sys.stdout.flush()
    try:
        proc = subprocess.run(python_command("escrow_client.demo", role, *argv),
                              stdin=subprocess.DEVNULL, cwd=CHILD_CWD, timeout=60)
    except subprocess.TimeoutExpired:
        print(f"escrowctl demo: the {role} step took over 60 s; stopped it", file=sys.stderr)
        return 1
    if proc.returncode != 0:
        print(f"escrowctl demo: the {role} step failed (exit status {proc.returncode})",
              file=sys.stderr)
    return proc.returncode


def leave_nothing(client: EscrowClient, sid: str, report: dict[str, Any]) -> None:
    """Leave nothing behind even when a step failed: release the session if escrowd still
    holds it, and end the shell if it still runs (and is still the same process)."""
    try:
        left = [s for s in client.list() if s.id == sid and s.state in LIVE_STATES]
        if left:
            client.release(sid)
            print(f"escrowctl demo: released {OWNER}/{sid}, left over", file=sys.stderr)
    except errors.EscrowError as exc:
        print(f"escrowctl demo: could not clean up {sid}: {exc} ({exc.code})", file=sys.stderr)
    pid, started = report.get("shell_pid"), report.get("shell_start_time")
    if isinstance(pid, int) and end_shell(pid, started):
        print(f"escrowctl demo: ended the demo shell (pid {pid}), left over", file=sys.stderr)


# --- entry point ------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--socket", metavar="PATH", help="the holder's socket")
    common.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, metavar="SECONDS")
    common.add_argument("--id", required=True, help="the session id")
    p = argparse.ArgumentParser(prog="python -m escrow_client.demo",
                                description="The two halves of `escrowctl demo`.")
    sub = p.add_subparsers(dest="role", required=True)
    app = sub.add_parser("app", parents=[common],
                         help="start a shell, show it, deposit it, exit")
    app.add_argument("--report", required=True, metavar="FILE",
                     help="write the shell's pid and last tick here, as JSON")
    reclaim = sub.add_parser("reclaim", parents=[common],
                             help="take the shell back and show what it missed")
    reclaim.add_argument("--shell-pid", type=int, required=True)
    reclaim.add_argument("--last-tick", type=int, default=0)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return run_app(args) if args.role == "app" else run_reclaim(args)
    except errors.EscrowError as exc:
        print(f"escrowctl demo: {exc} ({exc.code})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
