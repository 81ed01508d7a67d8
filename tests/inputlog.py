"""A program's keyboard, written down, for tests on a real screen: every byte it is given.

    inputlog.py LOG -- CMD...

runs CMD on a PTY of its own, the size of this terminal (kept so: a SIGWINCH here resizes
it), copies what CMD prints to this terminal and what this terminal gives (in raw mode) to
CMD, and appends each byte of the latter to LOG as it passes. A test that runs a program
under it in an escrowed session knows exactly what reached the program as typed input: the
keys the test typed, and anything else that came (a terminal's answer to a replayed
question). It exits with CMD's status once CMD has closed its terminal.
"""

from __future__ import annotations

import fcntl
import os
import select
import signal
import subprocess
import sys
import termios
import tty


def write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


def main() -> int:
    log_path, separator, *argv = sys.argv[1:]
    assert separator == "--" and argv, __doc__
    master, slave = os.openpty()
    termios.tcsetwinsize(slave, termios.tcgetwinsize(0))
    child = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave,
                             start_new_session=True,
                             preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
    os.close(slave)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGWINCH, lambda *_: None)
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    saved = termios.tcgetattr(0)
    tty.setraw(0)
    try:
        while True:
            readable = select.select([0, master, wake_r], [], [])[0]
            if wake_r in readable:
                os.read(wake_r, 512)
                termios.tcsetwinsize(master, termios.tcgetwinsize(0))
            if master in readable:
                try:
                    out = os.read(master, 65536)
                except OSError:  # EIO: CMD closed its terminal
                    break
                write_all(1, out)
            if 0 in readable:
                keys = os.read(0, 65536)
                if not keys:
                    break
                write_all(log, keys)
                write_all(master, keys)
    finally:
        termios.tcsetattr(0, termios.TCSADRAIN, saved)
    return child.wait()


if __name__ == "__main__":
    sys.exit(main())
