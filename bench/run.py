"""Every benchmark of fd-escrow, each beside a baseline measured in the same run.

    .venv/bin/python bench/run.py [--quick] [--json]

1. handoff: `retrieve` of a session with 64 KiB of replay from a client process (hello,
   retrieve, handoff with the fd, ack, done): p50 and p99, against a raw fd round trip over a
   socketpair between two processes.
2. reclaim: 100 draining sessions (64 KiB of replay each) taken back by one `reclaim_all`
   (replays by reference, where the platform can).
3. drain: a child writing 256 MiB (64 MiB with --quick) as fast as it can into a pty that the
   holder drains: MB/s and the holder's CPU seconds per GiB, against the same child with a
   plain blocking reader (and dtach, if it is installed). Each pair of runs pins reader and
   writer alike (same CPU, then split, in turn) unless --no-pin.
4. scale: 1,000 draining sessions with 64 KiB of replay each: holder RSS, open fds, CPU over
   idle seconds, and the time to reclaim them all: by reference, with the holder's CPU
   over it per session, then again on the copy path (each replay in its frame, as a client
   that does not ask gets), beside the floor each stands on (their fds and replays sent
   raw over a socketpair between two processes; the fds alone, two a session, no bytes).
5. start-up: from exec to the socket answering `status`, against `python -c pass`.
6. restart: `escrowd` as users run it (the keeper, its holder and its standby) with 1,000 draining
   sessions of 64 KiB of replay: from the SIGKILL of the serving holder to `status` answering
   from the next one with all 1,000 adopted, against a cold start of the pair to `status`
   and the same SIGKILL with no session.
7. deposit: a deposit under custody (hello done, one connection), p50 and p99, by a holder
   with a fd store (under the keeper: `deposited` only after the FDSTORE message) against the
   bare holder with none, interleaved.
8. journal: an app reading a child's 256 MiB flood (64 MiB with --quick) through
   `Custody.read`, with the journal on (each read recorded into the session's ring) against
   the same app with it off, in interleaved pairs: the ratio of the app's CPU seconds
   (`journal_read_overhead`) and of the wall time.
9. cli: `escrowctl status`, `list` and `--version` as a user's install runs them, exec to
   exit, against `python -c pass` in interleaved rounds, and `tmux has-session` as a peer
   (bench/cli_calls.py).

Baselines are C (compiled into a temp dir now) when a compiler is present, else Python.
Medians over repeats; the drain ratios are medians over interleaved pairs of runs. It
reports; it asserts nothing. --quick finishes in under a minute. `--only drain,journal`
runs only those (and prints JSON); `--drain-output FILE` has the child of the drain and the
journal write FILE's bytes over and over instead of text lines, holder and baseline alike
(a program's output, as recorded: full-screen programs print an ESC every few bytes).
"""

from __future__ import annotations

import argparse
import array
import contextlib
import glob
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import tty
from pathlib import Path
from typing import Any

import cli_calls
import psutil
from holder import READY_TIMEOUT, BenchHolder, wait_for
from targets import verdict

from escrow_client import EscrowClient, EscrowError
from escrow_client import retrieve as escrow_retrieve
from escrow_client.fdpass import ANCILLARY_SPACE, rights

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
HANDOFF_REPLAY = 64 * KiB
RECLAIM_REPLAY = 64 * KiB
SCALE_REPLAY = 64 * KiB
CLK_TCK = os.sysconf("SC_CLK_TCK")
HERE = Path(__file__).resolve().parent

# The Python fallbacks for the C baselines (bench/baselines.c).
PY_WRITER = """
import os, sys, tty
total = int(sys.argv[1])
if os.isatty(1):
    tty.setraw(1)
line = bytes(ord("a") + i % 26 for i in range(79)) + b"\\n"
buf = memoryview(line * 820)
while total > 0:
    total -= os.write(1, buf[:total])
"""
PY_FILE_WRITER = """
import os, sys, tty
data, total = open(sys.argv[1], "rb").read(), int(sys.argv[2])
if os.isatty(1):
    tty.setraw(1)
buf, at = memoryview(data * (131072 // len(data) + 2)), 0
while total > 0:
    n = os.write(1, buf[at : at + min(total, 65536)])
    total, at = total - n, (at + n) % len(data)
"""
DRAIN_OUTPUT: str | None = None  # --drain-output
PY_READER = """
import os
total = 0
while True:
    try:
        data = os.read(0, 65536)
    except OSError:
        break
    if not data:
        break
    total += len(data)
print(total)
"""


# --- helpers ------------------------------------------------------------------------------


def compile_baselines(tmp: str) -> str | None:
    """The C baselines' binary, or None when no compiler is around."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    out = os.path.join(tmp, "baselines")
    done = subprocess.run([cc, "-O2", "-o", out, str(HERE / "baselines.c")],
                          capture_output=True)
    return out if done.returncode == 0 else None


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (every thread), from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def cpu_ns(pid: int) -> int:
    """Time on CPU in ns, summed over every thread (/proc/<pid>/task/*/schedstat): finer
    than the clock ticks of /proc/<pid>/stat, for measuring almost nothing."""
    total = 0
    for path in glob.glob(f"/proc/{pid}/task/*/schedstat"):
        with contextlib.suppress(OSError), open(path) as f:
            total += int(f.read().split()[0])
    return total


def raise_fd_limit(wanted: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def raw_pty() -> tuple[int, int]:
    master, slave = os.openpty()
    tty.setraw(slave)
    return master, slave


def running_holder() -> BenchHolder:
    """A real holder on a temporary socket; its log is discarded, so that writing it adds
    nothing to what is measured."""
    return BenchHolder(log_path=os.devnull)


def deposit_all(client: EscrowClient, masters: dict[str, int]) -> None:
    """Deposit every master through one custody and end it: all of them start draining.
    The caller's copies are closed."""
    with client.custody() as custody:
        for sid, master in masters.items():
            custody.deposit(sid, master)
    for master in masters.values():
        os.close(master)


def fill(client: EscrowClient, slaves: dict[str, int], payload: bytes) -> None:
    """Write `payload` to every slave and wait until each session's replay holds it."""
    for slave in slaves.values():
        os.write(slave, payload)  # blocking: the holder drains as we write
    want = len(payload)
    wait_for(lambda: all(s.buffered_bytes == want for s in client.list()), 60,
             "the replays to fill", pause=0.005)


def median(values: list[float]) -> float:
    return float(statistics.median(values))


# --- 1. handoff latency -------------------------------------------------------------------


def fd_roundtrip_py(rounds: int) -> tuple[float, float]:
    """Median and p99 (µs) of sending a pty master to a child process and back."""
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
    return median(times), statistics.quantiles(times, n=100)[98]


def fd_roundtrip(baselines: str | None, rounds: int) -> tuple[float, float]:
    if baselines is None:
        return fd_roundtrip_py(rounds)
    out = subprocess.run([baselines, "roundtrip", str(rounds)], capture_output=True,
                         text=True, check=True).stdout.split()
    return float(out[0]), float(out[1])


def handoff_times_ms(rounds: int) -> list[float]:
    """`retrieve` of one session with 64 KiB of replay, `rounds` times; between rounds the
    session is handed back and its replay written again (not timed)."""
    with running_holder() as holder:
        client = holder.client("bench.handoff")
        master, slave = raw_pty()
        deposit_all(client, {"s": master})
        fill(client, {"s": slave}, b"y" * HANDOFF_REPLAY)
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            got = client.retrieve("s")
            times.append((time.perf_counter() - start) * 1e3)
            deposit_all(client, {"s": got.fd})
            os.write(slave, got.replay)
            wait_for(lambda: client.list()[0].buffered_bytes >= HANDOFF_REPLAY, 10,
                     "the replay", pause=0.0005)
        os.close(slave)
        return times


def bench_handoff(baselines: str | None, rounds: int) -> dict[str, Any]:
    rt_p50, rt_p99 = fd_roundtrip(baselines, max(rounds, 1000))
    times = handoff_times_ms(rounds)
    p50 = median(times)
    return {
        "handoff_p50_ms": p50,
        "handoff_p99_ms": statistics.quantiles(times, n=100)[98],
        "fd_roundtrip_us": rt_p50,
        "fd_roundtrip_p99_us": rt_p99,
        "handoff_vs_roundtrip": p50 * 1e3 / rt_p50,
        "handoff_rounds": rounds,
    }


# --- 2. reclaim at launch -----------------------------------------------------------------


@contextlib.contextmanager
def copy_path(on: bool = True) -> Any:
    """Within it, this process's client asks for no replay by reference: each replay comes
    in its frame, as it does to a client that does not ask (the C client, macOS)."""
    saved = escrow_retrieve.REPLAY_FILES
    escrow_retrieve.REPLAY_FILES = saved and not on
    try:
        yield
    finally:
        escrow_retrieve.REPLAY_FILES = saved


def reclaim_times_ms(sessions: int, repeats: int, replay: int) -> list[float]:
    with running_holder() as holder:
        client = holder.client("bench.reclaim")
        ptys = {f"s{i}": raw_pty() for i in range(sessions)}
        masters = {sid: m for sid, (m, _) in ptys.items()}
        slaves = {sid: s for sid, (_, s) in ptys.items()}
        times = []
        try:
            for _ in range(repeats):
                deposit_all(client, masters)
                fill(client, slaves, b"r" * replay)
                start = time.perf_counter()
                report = client.reclaim_all(deadline=60.0)
                times.append((time.perf_counter() - start) * 1e3)
                if report.failed or len(report.retrieved) != sessions:
                    raise RuntimeError(f"reclaim failed: {report.failed}")
                masters = {sid: got.fd for sid, got in report.retrieved.items()}
        finally:
            for fd in [*masters.values(), *slaves.values()]:
                os.close(fd)
        return times


def bench_reclaim(repeats: int, fd_roundtrip_us: float) -> dict[str, Any]:
    times = reclaim_times_ms(100, repeats, RECLAIM_REPLAY)
    ms = median(times)
    return {
        "reclaim_100_ms": ms,
        "reclaim_100_roundtrips_ms": 100 * fd_roundtrip_us / 1e3,
        "reclaim_per_session_ms": ms / 100,
    }


# --- 3. drain -----------------------------------------------------------------------------


def writer_cmd(baselines: str | None, total: int) -> list[str]:
    if DRAIN_OUTPUT is not None:
        return [sys.executable, "-c", PY_FILE_WRITER, DRAIN_OUTPUT, str(total)]
    if baselines is not None:
        return [baselines, "writer", str(total)]
    return [sys.executable, "-c", PY_WRITER, str(total)]


# Where the reader and the writer run, (reader CPU, writer CPU), or None: the scheduler's
# choice. Unpinned, a pty's throughput on a small VM swings by 2x with whether the two
# happened to share a CPU, so each pair of runs gets one placement, the same for every
# reader, cycling through same-CPU and split placements.
Placement = tuple[int, int] | None


def placements(count: int, pin: bool) -> list[Placement]:
    cpus = sorted(os.sched_getaffinity(0))
    if not pin or len(cpus) < 2:
        return [None] * count
    a, b = cpus[0], cpus[1]
    cycle: list[Placement] = [(a, a), (a, b), (b, b), (b, a)]
    return [cycle[i % len(cycle)] for i in range(count)]


def pinned_to(cpu: int | None) -> Any:
    """A preexec_fn that pins the child to `cpu` (None: leaves it alone)."""
    if cpu is None:
        return None
    return lambda: os.sched_setaffinity(0, {cpu})


def spawn_writer(baselines: str | None, total: int, slave: int,
                 placement: Placement) -> subprocess.Popen[bytes]:
    return subprocess.Popen(writer_cmd(baselines, total), stdout=slave,
                            preexec_fn=pinned_to(placement and placement[1]))


def drain_holder(
    holder: BenchHolder, baselines: str | None, total: int, run: int, placement: Placement = None
) -> tuple[float, float]:
    """(seconds, holder CPU seconds) for the holder to drain `total` bytes from a fast child,
    from the child's start to the session being `exited` with every byte accounted for."""
    client = holder.client("bench.drain")
    sid = f"drain-{run}"
    master, slave = raw_pty()
    deposit_all(client, {sid: master})
    if placement is not None:
        os.sched_setaffinity(holder.pid, {placement[0]})
    cpu0 = cpu_seconds(holder.pid)
    start = time.perf_counter()
    child = spawn_writer(baselines, total, slave, placement)
    os.close(slave)
    child.wait()

    def exited() -> Any:
        info = next(s for s in client.list() if s.id == sid)
        return info if info.state == "exited" else None

    info = wait_for(exited, 60, "the drain to finish", pause=0.001)
    elapsed = time.perf_counter() - start
    cpu = cpu_seconds(holder.pid) - cpu0
    if info.buffered_bytes + info.dropped_bytes != total:
        raise RuntimeError(f"holder drained {info.buffered_bytes + info.dropped_bytes} of {total}")
    client.release(sid)
    return elapsed, cpu


def drain_plain(
    baselines: str | None, total: int, placement: Placement = None
) -> tuple[float, float]:
    """The same child with a plain blocking reader: (seconds, reader CPU seconds)."""
    master, slave = raw_pty()
    cmd = [baselines, "reader"] if baselines else [sys.executable, "-c", PY_READER]
    reader = subprocess.Popen(cmd, stdin=master, stdout=subprocess.PIPE,
                              preexec_fn=pinned_to(placement and placement[0]))
    os.close(master)
    cpu0 = 0.0
    if baselines is None:  # let the interpreter start first; count only its reading
        time.sleep(0.2)
        cpu0 = cpu_seconds(reader.pid)
    start = time.perf_counter()
    child = spawn_writer(baselines, total, slave, placement)
    os.close(slave)
    _, _, usage = os.wait4(reader.pid, 0)
    elapsed = time.perf_counter() - start
    reader.returncode = 0
    assert reader.stdout is not None
    got = int(reader.stdout.read() or 0)
    reader.stdout.close()
    child.wait()
    if got != total:
        raise RuntimeError(f"plain reader read {got} of {total}")
    return elapsed, usage.ru_utime + usage.ru_stime - cpu0


def drain_dtach(
    baselines: str | None, total: int, tmp: str, placement: Placement = None
) -> tuple[float, float]:
    """dtach running the same child in a new detached session: (seconds, dtach CPU)."""
    sock = os.path.join(tmp, "dtach.sock")
    start = time.perf_counter()
    proc = subprocess.Popen(["dtach", "-N", sock, "-E", "-z", *writer_cmd(baselines, total)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL,
                            preexec_fn=pinned_to(placement and placement[0]))
    if placement is not None and placement[1] != placement[0]:
        # dtach forks the writer, which inherits dtach's CPU: move it as soon as it exists.
        children = f"/proc/{proc.pid}/task/{proc.pid}/children"
        with contextlib.suppress(OSError, ValueError, RuntimeError):
            pid = int(wait_for(lambda: open(children).read().split(), 5, "dtach's child",
                               pause=0.0002)[0])
            os.sched_setaffinity(pid, {placement[1]})
    _, _, usage = os.wait4(proc.pid, 0)  # dtach does not reap the child: its CPU is its own
    proc.returncode = 0
    return time.perf_counter() - start, usage.ru_utime + usage.ru_stime


def bench_drain(
    baselines: str | None, total: int, repeats: int, pin: bool = True
) -> dict[str, Any]:
    runs: dict[str, list[tuple[float, float]]] = {"holder": [], "plain": [], "dtach": []}
    dtach = shutil.which("dtach") is not None
    where = placements(repeats, pin)
    with running_holder() as holder, tempfile.TemporaryDirectory() as tmp:
        for run, placement in enumerate(where):  # interleaved: drift hits every reader alike
            runs["holder"].append(drain_holder(holder, baselines, total, run, placement))
            runs["plain"].append(drain_plain(baselines, total, placement))
            if dtach:
                runs["dtach"].append(drain_dtach(baselines, total, tmp, placement))

    def mb_s(name: str) -> float:
        return median([total / t / 1e6 for t, _ in runs[name]])

    def cpu_gib(name: str) -> float:
        return median([cpu / (total / GiB) for _, cpu in runs[name]])

    # Ratios are medians over the pairs (each holder run and the plain run right after it
    # share the machine's conditions), so drift on a busy machine cancels out.
    pairs = list(zip(runs["holder"], runs["plain"], strict=True))
    result = {
        "drain_mb_s": mb_s("holder"),
        "drain_baseline_mb_s": mb_s("plain"),
        "drain_ratio": median([tp / th for (th, _), (tp, _) in pairs]),
        "drain_cpu_s_per_gib": cpu_gib("holder"),
        "drain_baseline_cpu_s_per_gib": cpu_gib("plain"),
        "drain_cpu_ratio": median([ch / max(cp, 1e-3) for (_, ch), (_, cp) in pairs]),
        "drain_bytes": total,
        "drain_runs": repeats,
        "drain_pinned": where[0] is not None,
        "drain_baseline": "C" if baselines else "python",
    }
    if dtach:
        result["dtach_mb_s"] = mb_s("dtach")
        result["dtach_cpu_s_per_gib"] = cpu_gib("dtach")
    return result


# --- 4. scale -----------------------------------------------------------------------------


def bench_scale(sessions: int, idle_seconds: float) -> dict[str, Any]:
    raise_fd_limit(3 * sessions + 256)  # our masters and slaves, then the holder's copies
    with running_holder() as holder:
        rss_base, fds_base = holder.rss(), holder.open_fds()
        client = holder.client("bench.scale")
        ptys = {f"s{i}": raw_pty() for i in range(sessions)}
        slaves = {sid: s for sid, (_, s) in ptys.items()}
        masters = {sid: m for sid, (m, _) in ptys.items()}
        try:
            deposit_all(client, masters)
            fill(client, slaves, b"z" * SCALE_REPLAY)
            time.sleep(0.5)  # let the last wake-ups settle before measuring idle
            rss = holder.rss()
            fds = holder.open_fds()
            cpu0 = cpu_ns(holder.pid)
            time.sleep(idle_seconds)
            idle = (cpu_ns(holder.pid) - cpu0) / 1e9 / idle_seconds * 100
            reclaim_ms, holder_ns, masters = reclaim_timed(client, holder.pid, sessions)
            # The same again on the copy path, from the same holder.
            deposit_all(client, masters)
            fill(client, slaves, b"z" * SCALE_REPLAY)
            with copy_path():
                copy_ms, copy_ns, masters = reclaim_timed(client, holder.pid, sessions)
        finally:
            for fd in [*masters.values(), *slaves.values()]:
                os.close(fd)
    held = sessions * SCALE_REPLAY
    floor = reclaim_floor_ms(sessions, SCALE_REPLAY, 5)
    fds_floor = reclaim_floor_ms(sessions, 0, 5, fds_each=2)
    return {
        "rss_base_mb": rss_base / MiB,
        "rss_1000_sessions_mb": rss / MiB,
        "replay_held_mb": held / MiB,
        "rss_growth_per_replay": (rss - rss_base) / held,
        "open_fds_1000_sessions": fds,
        "open_fds_base": fds_base,
        "open_fds_per_session": (fds - fds_base) / sessions,
        "idle_cpu_percent": idle,
        "idle_seconds": idle_seconds,
        "reclaim_1000_ms": reclaim_ms,
        "reclaim_holder_us_per_session": holder_ns / 1e3 / sessions,
        "reclaim_1000_fds_floor_ms": fds_floor,
        "reclaim_1000_vs_fds_floor": reclaim_ms / fds_floor,
        "reclaim_1000_copy_ms": copy_ms,
        "reclaim_copy_holder_us_per_session": copy_ns / 1e3 / sessions,
        "reclaim_1000_floor_ms": floor,
        "reclaim_1000_copy_vs_floor": copy_ms / floor,
    }


def reclaim_timed(client: EscrowClient, holder_pid: int, sessions: int
                  ) -> tuple[float, int, dict[str, int]]:
    """One `reclaim_all` of every session: its ms, the holder's CPU ns over it, and the
    masters it took back."""
    cpu0 = cpu_ns(holder_pid)
    start = time.perf_counter()
    report = client.reclaim_all(deadline=120.0)
    ms = (time.perf_counter() - start) * 1e3
    holder_ns = cpu_ns(holder_pid) - cpu0
    masters = {sid: got.fd for sid, got in report.retrieved.items()}
    if report.failed or len(masters) != sessions:
        for fd in masters.values():
            os.close(fd)
        raise RuntimeError(f"reclaim of {sessions} failed: {len(report.failed)} failed")
    return ms, holder_ns, masters


def reclaim_floor_ms(sessions: int, replay: int, repeats: int, fds_each: int = 1) -> float:
    """The floor under reclaiming `sessions`, each with `replay` bytes: as many pty masters
    (`fds_each` of them a session: 2, a master and a replay file's fd) and bytes sent by
    one process and received, and kept, by another over a Unix socket, with nothing else
    done (no protocol, no state, no drains to stop). Median ms."""
    ptys = [os.openpty() for _ in range(sessions)]
    payload = b"z" * replay
    times = []
    try:
        for _ in range(repeats):
            sender, receiver = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            pid = os.fork()
            if pid == 0:  # the sender
                try:
                    receiver.close()
                    sender.recv(1)  # go
                    for master, slave in ptys:
                        sender.sendmsg([len(payload).to_bytes(4, "big"), payload],
                                       rights([master, slave][:fds_each]))
                finally:
                    os._exit(0)
            sender.close()
            kept: list[tuple[list[int], bytearray]] = []
            start = time.perf_counter()
            receiver.send(b"g")
            for _ in range(sessions):
                fds: list[int] = []
                head = receive_exactly(receiver, bytearray(4), fds)
                kept.append((fds, receive_exactly(receiver, bytearray(int.from_bytes(head,
                                                                                 "big")), fds)))
            times.append((time.perf_counter() - start) * 1e3)
            os.waitpid(pid, 0)
            receiver.close()
            for fds, _ in kept:
                for fd in fds:
                    os.close(fd)
    finally:
        for master, slave in ptys:
            os.close(master)
            os.close(slave)
    return median(times)


def receive_exactly(sock: socket.socket, buffer: bytearray, fds: list[int]) -> bytearray:
    view, got = memoryview(buffer), 0
    while got < len(buffer):
        n, ancdata, _, _ = sock.recvmsg_into([view[got:]], ANCILLARY_SPACE)
        if n == 0:
            raise RuntimeError("the sender stopped early")
        for _, _, data in ancdata:
            fds.extend(array.array("i", data[: len(data) - len(data) % 4]))
        got += n
    return buffer


# --- 5. start-up --------------------------------------------------------------------------


def bench_startup(repeats: int) -> dict[str, Any]:
    holder_ms, python_ms = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        python_ms.append((time.perf_counter() - start) * 1e3)
        with running_holder() as holder:
            holder_ms.append(holder.startup_s * 1e3)
    return {
        "startup_ms": median(holder_ms),
        "startup_python_ms": median(python_ms),
        "startup_vs_python": median(holder_ms) / median(python_ms),
    }


# --- 6. restart under the keeper -------------------------------------------------------------


def log_times(log_path: str, after: float) -> dict[str, float]:
    """From the log, after `after`: when the keeper saw its holder exit and started the
    next one, and when that one was listening, had adopted and was ready."""
    times: dict[str, float] = {}
    with open(log_path, errors="replace") as log:
        for line in log:
            fields = dict(part.split("=", 1) for part in line.split()[:3] if "=" in part)
            ts, event = float(fields.get("ts", 0)), fields.get("event", "")
            if ts < after:
                continue
            if event == "keeper_holder_exited" and not times:
                times = {"exited": ts}
            elif event == "keeper_started_holder" and "started" not in times:
                times["started"] = ts
            elif event in ("listening", "ready") and "started" in times:
                times.setdefault(event, ts)
            elif event == "adopted" and " sessions=" in line and "started" in times:
                times.setdefault("adopted", ts)
    return times


def ready_standby(pair: BenchHolder, serving: int) -> int:
    """The pid of the keeper's standby, once one is ready that is not `serving` (the keeper
    starts one once its holder is ready: escrowd.standby)."""
    assert pair.log_path is not None

    def ready() -> int | None:
        with open(pair.log_path or "", errors="replace") as log:
            pids = [int(line.split("standby_pid=")[1].split()[0]) for line in log
                    if " event=keeper_standby_ready " in line]
        return pids[-1] if pids and pids[-1] != serving else None

    return int(wait_for(ready, READY_TIMEOUT, "a ready standby"))


def kill_to_status_ms(pair: BenchHolder, expect: int) -> tuple[float, dict[str, float]]:
    """SIGKILL the serving holder, once its standby is ready; the time until `status`
    answers from the next one, which must have adopted `expect` sessions. Also the phases
    of the restart, from the log."""
    client = EscrowClient("bench.restart.admin", socket_path=pair.socket, timeout=60.0)
    before = client.status()
    ready_standby(pair, before.pid)
    pid = pair.serving_pid()
    assert pid is not None
    wall = time.time()
    start = time.perf_counter()
    os.kill(pid, 9)
    while True:
        try:
            status = client.status()  # waits in the keeper's listen backlog meanwhile
        except EscrowError:
            time.sleep(0.001)
            continue
        if status.instance != before.instance:
            break
    elapsed = (time.perf_counter() - start) * 1e3
    if status.adopted != expect:
        raise RuntimeError(f"the next holder adopted {status.adopted} of {expect} sessions")
    phases: dict[str, float] = {}
    if pair.log_path is not None:
        times = log_times(pair.log_path, wall)
        if "started" in times:
            phases = {f"{name}_ms": (ts - wall) * 1e3 for name, ts in times.items()}
    return elapsed, phases


def bench_restart(sessions: int, samples: int) -> dict[str, Any]:
    raise_fd_limit(3 * sessions + 256)
    cold, empty = [], []
    for _ in range(samples):
        with BenchHolder(keeper=True, name="cold") as pair:
            cold.append(pair.startup_s * 1e3)
            empty.append(kill_to_status_ms(pair, 0)[0])
    times: list[float] = []
    phases: list[dict[str, float]] = []
    standby_rss: list[float] = []
    with BenchHolder(keeper=True, name="restart") as pair:
        client = pair.client("bench.restart")
        ptys = {f"s{i}": raw_pty() for i in range(sessions)}
        slaves = {sid: s for sid, (_, s) in ptys.items()}
        try:
            deposit_all(client, {sid: m for sid, (m, _) in ptys.items()})
            fill(client, slaves, b"k" * SCALE_REPLAY)
            for _ in range(samples):
                # (The keeper restarts a holder that was serving at once: no back-off, unless
                # restarts pile up as in a crash loop, which a few samples do not.)
                standby = ready_standby(pair, client.status().pid)
                standby_rss.append(psutil.Process(standby).memory_info().rss / MiB)
                elapsed, phase = kill_to_status_ms(pair, sessions)
                times.append(elapsed)
                phases.append(phase)
            if any(s.buffered_bytes != SCALE_REPLAY for s in client.list()):
                raise RuntimeError("a session's replay changed across the restarts")
        finally:
            for fd in slaves.values():
                os.close(fd)
    best = phases[times.index(median_low(times))]
    return {
        "restart_1000_ms": median(times),
        "restart_1000_max_ms": max(times),
        "restart_empty_ms": median(empty),
        "cold_start_keeper_ms": median(cold),
        "restart_vs_cold_start": median(times) / median(cold),
        "restart_samples": samples,
        # Phases of the median restart, from its SIGKILL: the keeper saw its holder exit and
        # started the next, which was listening, had adopted every session, and was ready.
        "restart_phases_ms": {k: round(v, 1) for k, v in best.items()},
        # What the keeper's standby (the next holder, loaded and waiting) costs while it waits.
        "standby_rss_mb": median(standby_rss),
    }


def median_low(values: list[float]) -> float:
    return float(statistics.median_low(values))


# --- 7. deposit with and without the fd store ---------------------------------------------


def bench_deposit(rounds: int) -> dict[str, Any]:
    times: dict[str, list[float]] = {"store": [], "none": []}
    with running_holder() as bare, BenchHolder(keeper=True, log_path=os.devnull,
                                               name="deposit") as kept:
        assert kept.admin.status().fd_store == "keeper"
        assert bare.admin.status().fd_store == "none"
        custodies = {"store": kept.client("bench.deposit").custody(),
                     "none": bare.client("bench.deposit").custody()}
        try:
            for i in range(rounds):
                order = ["store", "none"] if i % 2 else ["none", "store"]
                for name in order:
                    master, slave = os.openpty()
                    try:
                        start = time.perf_counter()
                        custodies[name].deposit(f"d{i}", master)
                        times[name].append((time.perf_counter() - start) * 1e3)
                        custodies[name].release(f"d{i}")
                    finally:
                        os.close(master)
                        os.close(slave)
        finally:
            for custody in custodies.values():
                custody.close()
    p50, base = median(times["store"]), median(times["none"])
    return {
        "deposit_p50_ms": p50,
        "deposit_p99_ms": statistics.quantiles(times["store"], n=100)[98],
        "deposit_no_store_p50_ms": base,
        "deposit_no_store_p99_ms": statistics.quantiles(times["none"], n=100)[98],
        "deposit_store_vs_none": p50 / base,
        "deposit_rounds": rounds,
    }


# --- 8. the journal ------------------------------------------------------------------------


def journal_read(holder: BenchHolder, baselines: str | None, total: int, journal: bool,
                 run: int) -> tuple[float, float]:
    """An app reading a fast child's `total` bytes through `Custody.read` (64 KiB reads),
    recording each into the session's ring when `journal`: (seconds, the app's CPU
    seconds) from the child's start to the terminal's hang-up."""
    client = holder.client("bench.journal")
    sid = f"j{run}"
    master, slave = raw_pty()
    with client.custody() as custody:
        custody.deposit(sid, master, journal=journal)
        if custody.journaled(sid) != journal:
            raise RuntimeError("the holder did not grant the journal")
        cpu0, start = time.process_time(), time.perf_counter()
        child = spawn_writer(baselines, total, slave, None)
        os.close(slave)
        got = 0
        while True:
            try:
                data = custody.read(sid, 65536)
            except OSError:  # EIO: the child is gone and its last byte read
                break
            if not data:
                break
            got += len(data)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu0
        child.wait()
        custody.release(sid)
    os.close(master)
    if got != total:
        raise RuntimeError(f"the app read {got} of {total}")
    return elapsed, cpu


def bench_journal(baselines: str | None, total: int, pairs: int) -> dict[str, Any]:
    """The journal's cost to the app that reads: on against off, interleaved pairs."""
    runs: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    with running_holder() as holder:
        for i in range(pairs):
            for journal in ((True, False) if i % 2 else (False, True)):
                runs[journal].append(journal_read(holder, baselines, total, journal, 2 * i
                                                  + journal))
    cpu_ratio = median([on[1] / off[1] for on, off in zip(runs[True], runs[False],
                                                            strict=True)])
    wall_ratio = median([on[0] / off[0] for on, off in zip(runs[True], runs[False],
                                                             strict=True)])
    return {
        "journal_read_overhead": cpu_ratio,
        "journal_read_wall_ratio": wall_ratio,
        "journal_read_mb_s": total / MiB / median([on[0] for on in runs[True]]),
        "journal_off_read_mb_s": total / MiB / median([off[0] for off in runs[False]]),
        "journal_read_mb": total / MiB,
    }


# --- report -------------------------------------------------------------------------------


def table(r: dict[str, Any]) -> str:
    def f(value: float, digits: int = 2) -> str:
        return f"{value:,.{digits}f}"

    b = r["drain_baseline"]
    # (name, figure, baseline, ratio, the key whose target the last column shows)
    rows: list[tuple[str, str, str, str, str]] = [
        ("handoff p50", f"{f(r['handoff_p50_ms'], 3)} ms",
         f"fd round trip {f(r['fd_roundtrip_us'], 1)} µs", f"{f(r['handoff_vs_roundtrip'], 0)}×",
         "handoff_p50_ms"),
        ("handoff p99", f"{f(r['handoff_p99_ms'], 3)} ms",
         f"fd round trip p99 {f(r['fd_roundtrip_p99_us'], 1)} µs", "", "handoff_p99_ms"),
        ("reclaim 100 sessions", f"{f(r['reclaim_100_ms'], 1)} ms",
         f"100 fd round trips {f(r['reclaim_100_roundtrips_ms'], 1)} ms",
         f"{f(r['reclaim_100_ms'] / r['reclaim_100_roundtrips_ms'], 0)}×", "reclaim_100_ms"),
        (f"drain {r['drain_bytes'] // MiB} MiB", f"{f(r['drain_mb_s'], 0)} MB/s",
         f"plain reader ({b}) {f(r['drain_baseline_mb_s'], 0)} MB/s", f(r["drain_ratio"]),
         "drain_ratio"),
        ("drain CPU", f"{f(r['drain_cpu_s_per_gib'])} s/GiB",
         f"plain reader ({b}) {f(r['drain_baseline_cpu_s_per_gib'])} s/GiB",
         f(r["drain_cpu_ratio"]), "drain_cpu_ratio"),
    ]
    if "dtach_mb_s" in r:
        rows.append(("dtach (peer)", "", f"{f(r['dtach_mb_s'], 0)} MB/s, "
                     f"{f(r['dtach_cpu_s_per_gib'])} s/GiB", "", ""))
    rows += [
        ("RSS, 1000 sessions", f"{f(r['rss_1000_sessions_mb'], 1)} MiB",
         f"base {f(r['rss_base_mb'], 1)} MiB + replay {f(r['replay_held_mb'], 1)} MiB",
         f"{f(r['rss_growth_per_replay'])}× replay", "rss_growth_per_replay"),
        ("open fds, 1000 sessions", str(r["open_fds_1000_sessions"]),
         f"{r['open_fds_base']} with none", f"{f(r['open_fds_per_session'])} a session",
         "open_fds_per_session"),
        (f"idle CPU, 1000 sessions ({r['idle_seconds']:g} s)",
         f"{f(r['idle_cpu_percent'], 3)} %", "", "", "idle_cpu_percent"),
        ("reclaim 1000 sessions", f"{f(r['reclaim_1000_ms'], 0)} ms",
         f"their fds alone, 2 a session {f(r['reclaim_1000_fds_floor_ms'], 0)} ms",
         f"{f(r['reclaim_1000_vs_fds_floor'], 1)}×", "reclaim_1000_ms"),
        ("  holder CPU a session", f"{f(r['reclaim_holder_us_per_session'], 0)} µs",
         f"copy path {f(r['reclaim_copy_holder_us_per_session'], 0)} µs", "",
         "reclaim_holder_us_per_session"),
        ("  on the copy path", f"{f(r['reclaim_1000_copy_ms'], 0)} ms",
         f"their fds and replays sent raw {f(r['reclaim_1000_floor_ms'], 0)} ms",
         f"{f(r['reclaim_1000_copy_vs_floor'], 1)}×", "reclaim_1000_copy_ms"),
        ("start-up to status", f"{f(r['startup_ms'], 0)} ms",
         f"python -c pass {f(r['startup_python_ms'], 0)} ms", f"{f(r['startup_vs_python'], 1)}×",
         "startup_ms"),
        ("restart, 1000 sessions adopted", f"{f(r['restart_1000_ms'], 0)} ms",
         f"cold start of the pair {f(r['cold_start_keeper_ms'], 0)} ms",
         f"{f(r['restart_vs_cold_start'], 1)}×", "restart_1000_ms"),
        ("restart, no session", f"{f(r['restart_empty_ms'], 0)} ms", "", "", "restart_empty_ms"),
        ("cold start, keeper and holder", f"{f(r['cold_start_keeper_ms'], 0)} ms",
         f"python -c pass {f(r['startup_python_ms'], 0)} ms", "", "cold_start_keeper_ms"),
        ("standby RSS, waiting", f"{f(r['standby_rss_mb'], 1)} MiB", "", "", "standby_rss_mb"),
        ("deposit p50 (fd store)", f"{f(r['deposit_p50_ms'], 3)} ms",
         f"no fd store {f(r['deposit_no_store_p50_ms'], 3)} ms",
         f"{f(r['deposit_store_vs_none'])}", "deposit_p50_ms"),
        ("deposit p99 (fd store)", f"{f(r['deposit_p99_ms'], 3)} ms",
         f"no fd store {f(r['deposit_no_store_p99_ms'], 3)} ms", "", "deposit_p99_ms"),
        ("an app reading, journal on", f"{f(r['journal_read_mb_s'], 0)} MiB/s",
         f"journal off {f(r['journal_off_read_mb_s'], 0)} MiB/s",
         f"CPU {f(r['journal_read_overhead'])}, wall {f(r['journal_read_wall_ratio'])}",
         "journal_read_overhead"),
    ]
    if "cli_status_ms" in r:
        rows += cli_calls.rows(r)
    cells = [("benchmark", "fd-escrow", "baseline (same run)", "ratio", "target")]
    cells += [(name, value, base, ratio, verdict(r, key))
              for name, value, base, ratio, key in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(5)]
    lines = [" | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
             for row in cells]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    pinned = ("each pair pinned alike, same CPU and split in turn" if r["drain_pinned"]
              else "placed by the scheduler")
    lines.append(f"(drain ratios: medians over {r['drain_runs']} interleaved pairs of runs, "
                 f"{pinned}; MB = 10^6 bytes; restarts: medians of {r['restart_samples']})")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller runs (under a minute)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--no-pin", action="store_true",
                        help="drain: let the scheduler place reader and writer (noisier)")
    parser.add_argument("--only", default="", metavar="NAMES",
                        help="only these, comma-separated (handoff, reclaim, drain, scale, "
                        "startup, restart, deposit, journal, cli); prints JSON")
    parser.add_argument("--drain-output", metavar="FILE",
                        help="drain, journal: the child writes FILE's bytes over and over")
    args = parser.parse_args()
    quick = args.quick
    global DRAIN_OUTPUT
    DRAIN_OUTPUT = args.drain_output
    only = set(args.only.split(",")) if args.only else None

    def wanted(name: str) -> bool:
        return only is None or name in only

    with tempfile.TemporaryDirectory(prefix="esc-bench-c-") as tmp:
        baselines = compile_baselines(tmp)
        result: dict[str, Any] = {}
        if wanted("handoff"):
            result.update(bench_handoff(baselines, rounds=200 if quick else 1000))
        if wanted("reclaim"):
            roundtrip = result.get("fd_roundtrip_us") or fd_roundtrip(baselines, 1000)[0]
            result.update(bench_reclaim(3 if quick else 7, roundtrip))
        if wanted("drain"):
            result.update(bench_drain(baselines, (64 if quick else 256) * MiB,
                                      4 if quick else 8, pin=not args.no_pin))
        if wanted("scale"):
            result.update(bench_scale(1000, idle_seconds=2.0 if quick else 10.0))
        if wanted("startup"):
            result.update(bench_startup(3 if quick else 7))
        if wanted("restart"):
            result.update(bench_restart(1000, 1 if quick else 5))
        if wanted("deposit"):
            result.update(bench_deposit(200 if quick else 1000))
        if wanted("journal"):
            result.update(bench_journal(baselines, (64 if quick else 256) * MiB,
                                        3 if quick else 7))
        if wanted("cli"):
            result.update(cli_calls.bench_cli(7 if quick else cli_calls.RUNS))
    result["quick"] = quick
    if args.json or only is not None:
        print(json.dumps(result))
    else:
        print(table(result))


if __name__ == "__main__":
    main()
