"""A terminal app for the reattach tests (docs/design.md §12), run as its own process so that a
test can SIGKILL it:

    reattach_app.py SOCKET SID OUT new [--journal]
        starts a shell printing numbered lines (L1, L2, ... every 10 ms) in a new PTY and
        deposits it under custody;
    reattach_app.py SOCKET SID OUT reclaim [--journal]
        takes every session back into custody (`Custody.reclaim_all`) and writes the
        replay of SID to OUT.replay.

Either way it then reads the session for as long as it lives (through `Custody.read`, which
records into the journal when there is one), appending what it reads to OUT, and prints
`ready <child pid> <replay_journaled>` once custody is confirmed. It waits for the terminal
with select before each read; with `--blocking` it waits in the read instead. With `--idle`
the shell prints 20 lines and then nothing.
"""

from __future__ import annotations

import fcntl
import os
import select
import signal
import subprocess
import sys
import termios

from escrow_client import EscrowClient

TICKER = ["sh", "-c", "i=0; while :; do i=$((i+1)); echo L$i; sleep 0.01; done"]
TWENTY = ["sh", "-c", "i=0; while [ $i -lt 20 ]; do i=$((i+1)); echo L$i; done; exec sleep 600"]


def main() -> None:
    socket_path, sid, out_path, mode = sys.argv[1:5]
    journal = "--journal" in sys.argv[5:]
    blocking = "--blocking" in sys.argv[5:]
    custody = EscrowClient("com.example.term", socket_path=socket_path).custody()
    journaled = 0
    if mode == "new":
        master, slave = os.openpty()
        child = subprocess.Popen(  # its terminal's session leader: SIGHUP if it hangs up
            TWENTY if "--idle" in sys.argv[5:] else TICKER, stdin=slave, stdout=slave,
            stderr=slave, start_new_session=True,
            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
        os.close(slave)
        custody.deposit(sid, master, child_pid=child.pid, journal=journal)
        pid = child.pid
    else:
        report = custody.reclaim_all(journal=journal)
        retrieved = report.retrieved[sid]
        with open(out_path + ".replay", "wb") as replay:
            replay.write(retrieved.replay)
        master, pid, journaled = retrieved.fd, retrieved.session.child_pid or 0, \
            retrieved.replay_journaled
    print("ready", pid, journaled, flush=True)
    # SIGUSR1: stop reading (after writing out what was read) and say so, so that a test's
    # SIGKILL cannot fall between a read and its write to OUT.
    paused: list[bool] = []
    signal.signal(signal.SIGUSR1, lambda *_: paused.append(True))
    with open(out_path, "ab", buffering=0) as out:
        while not paused:
            if blocking or select.select([master], [], [], 0.05)[0]:
                out.write(custody.read(sid))
    with open(out_path + ".paused", "w"):
        pass
    signal.pause()


if __name__ == "__main__":
    main()
