"""Handoff latency against a raw fd round trip, measured in the same run.

    .venv/bin/python bench/handoff_latency.py [--rounds N] [--json]

Starts a real holder on a temporary socket, escrows a PTY master with 64 KiB of replay,
and times `retrieve` (hello, retrieve, handoff with the fd, ack, done) followed by a
`hand_off` that puts it back, many times. The baseline is one fd sent over a socketpair to
another process and sent back. It reports; it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from escrow_client import EscrowClient
from escrow_client.fdpass import ANCILLARY_SPACE, rights

REPLAY = 64 * 1024


def raw_roundtrip_us(rounds: int) -> list[float]:
    """Send a pty master to a child process over a socketpair and get it back."""
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:
        parent.close()
        while True:
            data, anc, _, _ = child.recvmsg(1, ANCILLARY_SPACE)
            if not data:
                os._exit(0)
            fd = int.from_bytes(anc[0][2][:4], sys.byteorder)
            child.sendmsg([b"x"], rights(fd))
            os.close(fd)
    child.close()
    master, slave = os.openpty()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        parent.sendmsg([b"x"], rights(master))
        _, anc, _, _ = parent.recvmsg(1, ANCILLARY_SPACE)
        times.append((time.perf_counter() - start) * 1e6)
        os.close(int.from_bytes(anc[0][2][:4], sys.byteorder))
    parent.close()
    os.waitpid(pid, 0)
    os.close(master)
    os.close(slave)
    return times


def handoff_ms(rounds: int) -> list[float]:
    directory = tempfile.mkdtemp(prefix="esc-bench-")
    sock = os.path.join(directory, "escrowd.sock")
    holder = subprocess.Popen([sys.executable, "-m", "escrowd", "--socket", sock],
                              stderr=subprocess.DEVNULL)
    try:
        client = EscrowClient("bench.handoff", socket_path=sock)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.status()
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
        master, slave = os.openpty()
        client.hand_off("s", master)
        os.close(master)
        os.write(slave, b"y" * REPLAY)  # the holder drains it into the replay
        while client.list()[0].buffered_bytes < REPLAY:
            time.sleep(0.01)
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            got = client.retrieve("s")
            times.append((time.perf_counter() - start) * 1e3)
            # Put it back with the same replay size for the next round.
            client.hand_off("s", got.fd)
            os.close(got.fd)
            os.write(slave, got.replay)
            while client.list()[0].buffered_bytes < REPLAY:
                time.sleep(0.001)
        os.close(slave)
        return times
    finally:
        holder.terminate()
        holder.wait()
        shutil.rmtree(directory, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    raw = raw_roundtrip_us(args.rounds)
    handoff = handoff_ms(args.rounds)
    q = statistics.quantiles(handoff, n=100)
    result = {
        "handoff_p50_ms": statistics.median(handoff),
        "handoff_p99_ms": q[98],
        "fd_roundtrip_us": statistics.median(raw),
        "handoff_vs_roundtrip": statistics.median(handoff) * 1e3 / statistics.median(raw),
        "replay_bytes": REPLAY,
        "rounds": args.rounds,
    }
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:24} {value:.3f}" if isinstance(value, float) else f"{key:24} {value}")


if __name__ == "__main__":
    main()
