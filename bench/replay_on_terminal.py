"""A replay on a real terminal: what `escrowctl attach` does to a replay before it shows it.

    .venv/bin/python bench/replay_on_terminal.py [--rounds N] [--escrowctl CMD] [--json]

`safe_replay` and `after_replay` on a MiB of each of three kinds of output (full-screen
frames with an ESC every seven bytes, as htop's; coloured lines, as `ls --color`'s; UTF-8
text, whose continuation bytes include the 8-bit controls' values), medians of 20; the
cost of `Replies` per read of a typed key; and `escrowctl attach` from its start to the
end of the replay it writes (what follows, the resets and its own question, is a dozen
bytes in the same write), with a MiB of the first kind as the session's replay, read from
a bare PTY, median of `--rounds`. `--escrowctl` times another escrowctl (a
command line; say, the code before this in a checkout of its own), for paired runs. It
reports; it asserts nothing.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import termios
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from holder import BenchHolder, read_until, wait_for

from escrow_client import after_replay, safe_replay
from escrow_client.replies import Replies

MIB = 1 << 20
OWNER = "com.example.bench"


def dense() -> bytes:
    """Full-screen frames: a cursor move, a colour, a cell or a few, a reset, row by row."""
    rows = []
    for row in range(1, 41):
        cells = b"".join(b"\x1b[3%dm%d\x1b[0m " % (col % 8, col) for col in range(12))
        rows.append(b"\x1b[%d;1H" % row + cells + b"\x1b[K")
    frame = b"".join(rows) + b"\x1b[?25l\x1b[41;1H\x1b[?25h"
    return _mib(frame)


def lines() -> bytes:
    entry = b"\x1b[01;34mdirectory\x1b[0m  \x1b[01;32mprogram\x1b[0m  a_plain_file.txt\r\n"
    return _mib(entry)


def utf8() -> bytes:
    return _mib("漢字かな交じり文 — ✓ ✛ 😀 \x1b[1mнарод\x1b[0m\r\n".encode())


def _mib(unit: bytes) -> bytes:
    return (unit * (1 + MIB // len(unit)))[:MIB]


def median_ms(fn: Callable[[], object], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2] * 1000


def bench_functions() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, replay in (("dense", dense()), ("lines", lines()), ("utf8", utf8())):
        out[f"safe_replay_{name}_ms"] = median_ms(lambda r=replay: safe_replay(r), 20)
        out[f"after_replay_{name}_ms"] = median_ms(lambda r=replay: after_replay(r), 20)
        out[f"esc_every_{name}"] = round(len(replay) / max(1, replay.count(b"\x1b")), 1)
    replies = Replies(time.monotonic())
    keys = 10000
    out["replies_per_key_us"] = median_ms(
        lambda: [replies.feed(b"a", 0.0) for _ in range(keys)], 5) * 1000 / keys
    return out


def attach_once(escrowctl: list[str], socket: str, sid: str, until: bytes) -> float:
    """Seconds from starting `escrowctl attach` on a fresh PTY to `until` read from it (at
    the end of what it wrote, or a few bytes before)."""
    master, slave = os.openpty()
    termios.tcsetwinsize(slave, (40, 120))

    def controlling_tty() -> None:
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    started = time.perf_counter()
    proc = subprocess.Popen([*escrowctl, "--socket", socket, "attach", f"{OWNER}/{sid}"],
                            stdin=slave, stdout=slave, stderr=slave,
                            preexec_fn=controlling_tty, close_fds=True)
    os.close(slave)
    try:
        shown = read_until(master, lambda out: until in out[-256:], 30.0)
        took = time.perf_counter() - started
        if until not in shown[-256:]:
            raise RuntimeError(f"escrowctl attach wrote {len(shown)} bytes, not ending "
                               f"with {until!r}")
        proc.send_signal(signal.SIGTERM)  # detach: the holder drains the session again
        read_until(master, lambda out: False, 10.0)  # its last words, until it hangs up
        proc.wait(10)
        return took
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)


def bench_attach(escrowctl: list[str], rounds: int) -> dict[str, Any]:
    replay = dense()
    with tempfile.TemporaryDirectory(prefix="esc-bench-r-") as tmp, BenchHolder() as holder:
        path = Path(tmp) / "replay"
        path.write_bytes(replay)
        master, slave = os.openpty()
        termios.tcsetwinsize(slave, (40, 120))
        attrs = termios.tcgetattr(slave)
        attrs[1] &= ~termios.OPOST  # the bytes as they are, no CR added
        termios.tcsetattr(slave, termios.TCSANOW, attrs)
        program = subprocess.Popen(["sh", "-c", f"cat {shlex.quote(str(path))}; exec sleep 600"],
                                   stdin=slave, stdout=slave, stderr=slave,
                                   start_new_session=True, close_fds=True)
        os.close(slave)
        client = holder.client(OWNER)
        try:
            client.hand_off("r", master, child_pid=program.pid, cols=120, rows=40)
            os.close(master)
            wait_for(lambda: any(s.id == "r" and s.buffered_bytes >= MIB - 4096
                                 for s in client.list()), 30.0, "the replay in the ring")
            times = []
            for _ in range(rounds):
                # The replay's last bytes: what this escrowctl writes after them (the resets,
                # its question: a dozen bytes) goes in the same write.
                times.append(attach_once(escrowctl, holder.socket, "r", replay[-64:]))
                wait_for(lambda: any(s.id == "r" and s.state == "draining"
                                     for s in client.list()), 10.0, "the detach")
        finally:
            client.release("r")
            program.kill()
            program.wait()
    return {"attach_to_replay_shown_ms": sorted(times)[len(times) // 2] * 1000}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--escrowctl", default=None,
                        help="another escrowctl to time (a command line)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    escrowctl = (shlex.split(args.escrowctl) if args.escrowctl
                 else [str(Path(sys.executable).with_name("escrowctl"))])
    result = {**(bench_functions() if args.escrowctl is None else {}),
              **bench_attach(escrowctl, args.rounds)}
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:28} {value:.3f}" if isinstance(value, float) else f"{key:28} {value}")


if __name__ == "__main__":
    main()
