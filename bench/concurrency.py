"""Concurrency soak: many clients depositing, listing, retrieving and releasing at once.

    .venv/bin/python bench/concurrency.py [--clients 50] [--seconds 60] [--json]
                                          [--children 10] [--seed S] [--socket PATH]

Every client is a thread with its own `EscrowClient` and its own owner name, so each knows
exactly what the holder must say about its sessions. Without --socket it starts its own
holder in a temporary directory. For the given time each client picks, at random:

- `deposit`: a new session, escrowed with `hand_off`. It is a bare PTY pair on a raw slave:
  the client drops its copy of the master, keeps the slave, and writes a known payload into
  it, so it knows every byte the holder must give back.
- `write`: more payload into one of its escrowed sessions (the holder drains it meanwhile).
- `retrieve`: takes a session back with the real client; the replay followed by what is
  still readable from the fd must be exactly the bytes written since it was escrowed (no
  loss, no repeat), and `confirmed` must be set. Most go back to the holder (`hand_off`);
  some are kept, i.e. closed by the client that now owns them.
- `release`: drops a session.
- `list`: every session it has escrowed must be `draining`; every one it took back must be
  `handed_off` with the `handoff_id` it acked (or `unknown` once the tombstone is evicted);
  every one it released must be `released` (or `unknown`).
- `status`: the holder's status (the holder is alive).

The first --children clients also have one session each whose child is a real bash printing
numbered lines (`L1`, `L2`, ...) every 50 ms; each retrieve of it reads the replay and some
live output and checks the numbers run on with no gap across the whole run.

At the end every client retrieves its bash sessions once more (a last contiguity check) and
releases everything. Invariants, each a counter that must be 0: holder_died, sessions_lost
(a session missing or in a state it cannot be in), bad_states, duplicate_handoffs (the
holder counted more completed handoffs than acks were sent, or a handoff_id that is not
ours), replay_mismatches, sequence_gaps, fds_leaked (the holder's open fds after everything
is released, against its baseline), unexpected_errors (every error: no client ever touches
another's sessions, so none is expected). Prints a JSON summary (`--json`): operations per
kind with p50/p99 latency, errors by code, elapsed, and the holder's RSS and fds before and
after. Exit status 0 only when every invariant counter is 0.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import statistics
import subprocess
import sys
import threading
import time
import tty
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from holder import BenchHolder, end_shell, read_until, spawn_numbered_shell

from escrow_client import EscrowClient, EscrowError

INVARIANTS = ("holder_died", "sessions_lost", "bad_states", "duplicate_handoffs",
              "replay_mismatches", "sequence_gaps", "fds_leaked", "unexpected_errors")
MAX_LIVE = 6  # sessions escrowed per client at most
OPS = {"deposit": 3, "write": 2, "retrieve": 3, "release": 1, "list": 3, "status": 1}
_LINE = re.compile(rb"L(\d+)")


@dataclass
class Pair:
    """A bare PTY pair: the holder has the master, the client writes into the slave."""

    sid: str
    slave: int
    pending: bytearray = field(default_factory=bytearray)  # written since escrowed
    written: int = 0


@dataclass
class Shell:
    """A bash printing numbered lines; the client keeps the whole record of its output."""

    sid: str
    master: int  # the client's own copy, unread while escrowed; closed at the end
    proc: subprocess.Popen[bytes]
    record: bytearray = field(default_factory=bytearray)
    checked_to: int = 0
    last_line: int = 0

    def check(self) -> int:
        """Check the complete lines recorded since the last check; return the breaks."""
        end = self.record.rfind(b"\n") + 1
        breaks = 0
        for raw in bytes(self.record[self.checked_to:end]).split(b"\n")[:-1]:
            match = _LINE.fullmatch(raw.rstrip(b"\r"))
            number = int(match.group(1)) if match else -1
            if number != self.last_line + 1:
                breaks += 1
                print(f"concurrency: {self.sid}: after L{self.last_line} came {raw!r}",
                      file=sys.stderr)
            self.last_line = number
        self.checked_to = max(self.checked_to, end)
        return breaks


def spawn_shell(sid: str) -> Shell:
    master, proc = spawn_numbered_shell(0.05)
    return Shell(sid, master, proc)


class Stats:
    """Counters shared by every client thread (under one lock)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ops: Counter[str] = Counter()
        self.latency: dict[str, list[float]] = {}
        self.errors: Counter[str] = Counter()
        self.counts: Counter[str] = Counter()
        self.acks = 0  # confirmed retrieves: each is exactly one completed handoff
        self.live = 0
        self.peak_live = 0

    def op(self, kind: str, seconds: float) -> None:
        with self.lock:
            self.ops[kind] += 1
            self.latency.setdefault(kind, []).append(seconds)

    def bad(self, counter: str, why: str) -> None:
        with self.lock:
            self.counts[counter] += 1
        print(f"concurrency: {counter}: {why}", file=sys.stderr)

    def add_live(self, n: int) -> None:
        with self.lock:
            self.live += n
            self.peak_live = max(self.peak_live, self.live)


class Worker(threading.Thread):
    def __init__(self, index: int, socket_path: str, seed: int, until: float, stats: Stats,
                 shell: Shell | None) -> None:
        super().__init__(name=f"client-{index}", daemon=True)
        self.owner = f"bench.conc.c{index}"
        self.client = EscrowClient(self.owner, socket_path=socket_path)
        self.rng = random.Random(seed)
        self.until = until
        self.stats = stats
        self.pairs: dict[str, Pair] = {}  # escrowed
        self.shells: dict[str, Shell] = {}  # escrowed
        self.ended: dict[str, str | None] = {}  # taken back (handoff_id) or released (None)
        self.next_id = 0
        self.crashed: BaseException | None = None
        if shell is not None:
            self.shells[shell.sid] = shell

    # --- the loop ------------------------------------------------------------------------

    def run(self) -> None:
        try:
            for shell in self.shells.values():
                self.timed("deposit", lambda s=shell: self.client.hand_off(
                    s.sid, s.master, child_pid=s.proc.pid, label="bash"))
                self.stats.add_live(1)
            kinds, weights = list(OPS), list(OPS.values())
            while time.monotonic() < self.until:
                kind = self.rng.choices(kinds, weights)[0]
                getattr(self, f"do_{kind}")()
            self.finish()
        except BaseException as exc:  # a bug in the bench itself: report it, loudly
            self.crashed = exc
            import traceback

            traceback.print_exc()

    def timed(self, kind: str, call: Any) -> Any:
        start = time.perf_counter()
        try:
            result = call()
        except EscrowError as exc:
            with self.stats.lock:
                self.stats.errors[exc.code] += 1
                self.stats.counts["unexpected_errors"] += 1
            print(f"concurrency: {self.owner}: {kind} failed: {exc.code}: {exc}",
                  file=sys.stderr)
            raise
        self.stats.op(kind, time.perf_counter() - start)
        return result

    # --- operations ----------------------------------------------------------------------

    def do_deposit(self) -> None:
        if len(self.pairs) + len(self.shells) >= MAX_LIVE:
            return self.do_retrieve()
        self.next_id += 1
        sid = f"p{self.next_id}"
        if self.ended and self.rng.random() < 0.2:  # a relaunched app reuses its ids
            sid = self.rng.choice(sorted(self.ended))
        master, slave = os.openpty()
        tty.setraw(slave)
        try:
            self.timed("deposit", lambda: self.client.hand_off(sid, master, label="pair"))
        except EscrowError:
            os.close(slave)
            return None
        finally:
            os.close(master)  # the holder is the reader now
        self.ended.pop(sid, None)
        self.pairs[sid] = pair = Pair(sid, slave)
        self.stats.add_live(1)
        self.write(pair)
        return None

    def write(self, pair: Pair) -> None:
        start = time.perf_counter()
        size = self.rng.randint(64, 4096)
        data = b"".join(b"%s:%08d\n" % (pair.sid.encode(), pair.written + i)
                        for i in range(size // 12 + 1))[:size]
        view = memoryview(data)
        while view:
            view = view[os.write(pair.slave, view):]
        pair.pending += data
        pair.written += len(data)
        self.stats.op("write", time.perf_counter() - start)

    def do_write(self) -> None:
        if self.pairs:
            self.write(self.pairs[self.rng.choice(sorted(self.pairs))])

    def do_retrieve(self) -> None:
        live = sorted(self.pairs) + sorted(self.shells)
        if not live:
            return
        sid = self.rng.choice(live)
        try:
            got = self.timed("retrieve", lambda: self.client.retrieve(sid))
        except EscrowError:
            self.resync(sid)
            return
        with self.stats.lock:
            self.stats.acks += 1
        if not got.confirmed:
            self.stats.bad("sessions_lost", f"{self.owner}/{sid}: retrieve not confirmed")
        if got.dropped_bytes:
            self.stats.bad("replay_mismatches", f"{self.owner}/{sid}: {got.dropped_bytes} B "
                           "dropped under a 1 MiB ring")
        keep = True
        try:
            if sid in self.pairs:
                pair = self.pairs[sid]
                want = bytes(pair.pending)
                rest = read_until(got.fd,
                                  lambda out: len(got.replay) + len(out) >= len(want), 2.0)
                if got.replay + rest != want:
                    self.stats.bad("replay_mismatches",
                                   f"{self.owner}/{sid}: replay {len(got.replay)} B + live "
                                   f"{len(rest)} B is not the {len(want)} B written")
                pair.pending.clear()
                keep = self.rng.random() < 0.7
            else:
                shell = self.shells[sid]
                live_out = read_until(got.fd, lambda out: b"\n" in out, 2.0)
                shell.record += got.replay + live_out
                breaks = shell.check()
                if breaks:
                    self.stats.bad("sequence_gaps", f"{self.owner}/{sid}: {breaks} break(s)")
            if keep:
                try:
                    self.timed("deposit", lambda: self.client.hand_off(
                        sid, got.fd, label="again"))
                    return
                except EscrowError:
                    keep = False
            # Not handed back: this client owns it now and ends it by closing its copies.
            self.ended[sid] = got.handoff_id
            self.stats.add_live(-1)
            if sid in self.pairs:
                os.close(self.pairs.pop(sid).slave)
            self.shells.pop(sid, None)
        finally:
            os.close(got.fd)

    def do_release(self) -> None:
        if not self.pairs:
            return
        sid = self.rng.choice(sorted(self.pairs))
        try:
            self.timed("release", lambda: self.client.release(sid))
        except EscrowError:
            self.resync(sid)
            return
        os.close(self.pairs.pop(sid).slave)
        self.ended[sid] = None
        self.stats.add_live(-1)

    def do_list(self) -> None:
        try:
            infos = {s.id: s for s in self.timed("list", self.client.list)}
        except EscrowError:
            return
        for sid in list(self.pairs) + list(self.shells):
            info = infos.get(sid)
            state = info.state if info is not None else "unknown"
            if state != "draining":
                self.stats.bad("sessions_lost" if state in ("unknown", "released",
                                                             "expired") else "bad_states",
                               f"{self.owner}/{sid}: escrowed, but {state}")
        for sid, handoff_id in self.ended.items():
            info = infos.get(sid)
            state = info.state if info is not None else "unknown"
            if state == "unknown":
                continue  # an evicted tombstone
            if handoff_id is None and state != "released":
                self.stats.bad("bad_states", f"{self.owner}/{sid}: released, but {state}")
            elif handoff_id is not None and state != "handed_off":
                self.stats.bad("bad_states", f"{self.owner}/{sid}: taken back, but {state}")
            elif handoff_id is not None and info is not None and info.handoff_id != handoff_id:
                self.stats.bad("duplicate_handoffs", f"{self.owner}/{sid}: handed off to "
                               f"{info.handoff_id}, we acked {handoff_id}")

    def do_status(self) -> None:
        with contextlib.suppress(EscrowError):
            self.timed("status", self.client.status)

    def resync(self, sid: str) -> None:
        """After an error on `sid`: believe the holder, and count a session it lost."""
        try:
            infos = {s.id: s for s in self.client.list()}
        except EscrowError:
            return
        info = infos.get(sid)
        if info is None or info.state != "draining":
            self.stats.bad("sessions_lost", f"{self.owner}/{sid}: after an error it is "
                           f"{info.state if info else 'unknown'}")
            if sid in self.pairs:
                os.close(self.pairs.pop(sid).slave)
            self.shells.pop(sid, None)
            self.stats.add_live(-1)

    def finish(self) -> None:
        """A last look at every bash session, then release everything."""
        for sid in list(self.shells):
            try:
                got = self.timed("retrieve", lambda s=sid: self.client.retrieve(s))
            except EscrowError:
                continue
            with self.stats.lock:
                self.stats.acks += 1
            shell = self.shells.pop(sid)
            try:
                shell.record += got.replay + read_until(got.fd, lambda out: b"\n" in out, 2.0)
                if shell.check():
                    self.stats.bad("sequence_gaps", f"{self.owner}/{sid}: final check")
            finally:
                os.close(got.fd)
            self.ended[sid] = got.handoff_id
            self.stats.add_live(-1)
            with self.stats.lock:
                self.stats.counts["lines_checked"] += shell.last_line
        for sid in list(self.pairs):
            with contextlib.suppress(EscrowError):
                self.timed("release", lambda s=sid: self.client.release(s))
            os.close(self.pairs.pop(sid).slave)
            self.ended[sid] = None
            self.stats.add_live(-1)
        self.do_list()


def _quantiles(values: list[float]) -> dict[str, float]:
    if len(values) < 2:
        return {"p50_ms": round(values[0] * 1e3, 3) if values else 0.0, "p99_ms": 0.0}
    q = statistics.quantiles(values, n=100)
    return {"p50_ms": round(statistics.median(values) * 1e3, 3), "p99_ms": round(q[98] * 1e3, 3)}


def run(clients: int, seconds: float, children: int, seed: int,
        socket_path: str | None = None) -> dict[str, Any]:
    holder = BenchHolder(socket_path, name="conc")
    shells: list[Shell] = []
    try:
        before = holder.admin.status()
        stats = Stats()
        # Children are spawned here, before any thread exists (fork and threads do not mix).
        shells = [spawn_shell("bash") for _ in range(min(children, clients))]
        started = time.monotonic()
        until = started + seconds
        workers = [Worker(i, holder.socket, seed * 1000 + i, until, stats,
                          shells[i] if i < len(shells) else None) for i in range(clients)]
        for worker in workers:
            worker.start()
        holder_died = 0
        while any(w.is_alive() for w in workers):
            for worker in workers:
                worker.join(0.2)
            if not holder.alive():
                holder_died = 1
                break
            if time.monotonic() > until + 120:
                print("concurrency: clients still running 120 s after the end", file=sys.stderr)
                break
        elapsed = time.monotonic() - started
        crashed = sum(1 for w in workers if w.crashed is not None or w.is_alive())

        counts = stats.counts
        counts["holder_died"] = holder_died
        extra: dict[str, Any] = {}
        if not holder_died:
            status = holder.admin.status()
            handoffs = status.counters.get("handoffs", 0) - before.counters.get("handoffs", 0)
            if handoffs > stats.acks:
                counts["duplicate_handoffs"] += handoffs - stats.acks
            if handoffs < stats.acks:
                stats.bad("sessions_lost", f"the holder counts {handoffs} handoffs, "
                          f"{stats.acks} were confirmed")
            left = [s for s in holder.admin.list(all_owners=True)
                    if s.owner.startswith("bench.conc.c") and s.state not in
                    ("handed_off", "released")]
            for info in left:
                stats.bad("bad_states", f"{info.owner}/{info.id} is {info.state} at the end")
            fds = holder.settled_fds(before.open_fds or 0)
            counts["fds_leaked"] = max(0, fds - (before.open_fds or 0))
            after = holder.admin.status()
            extra = {"handoffs_by_holder": handoffs, "acks": stats.acks,
                     "rss_after": after.rss_bytes, "fds_after": fds,
                     "bad_requests_by_holder": after.counters.get("bad_requests", 0)}
        total_ops = sum(stats.ops.values())
        return {
            "clients": clients, "seconds": seconds, "children": len(shells), "seed": seed,
            "elapsed_s": round(elapsed, 2),
            **{k: counts[k] for k in INVARIANTS},
            "bench_crashes": crashed,
            "ops": dict(stats.ops), "ops_total": total_ops,
            "ops_per_s": round(total_ops / max(elapsed, 1e-9), 1),
            "latency": {k: _quantiles(v) for k, v in sorted(stats.latency.items())},
            "errors": dict(stats.errors),
            "lines_checked": counts["lines_checked"],
            "peak_live_sessions": stats.peak_live,
            "rss_before": before.rss_bytes, "fds_before": before.open_fds,
            "internal_errors_logged": holder.log_count("internal_error"),
            **extra,
        }
    finally:
        for shell in shells:
            end_shell(shell.proc, shell.master)
        holder.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--children", type=int, default=10,
                        help="clients that also escrow a bash printing numbered lines")
    parser.add_argument("--seed", type=int, default=None, help="default: a random one")
    parser.add_argument("--socket", default=None,
                        help="use the holder on this socket (default: start one)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 32)
    result = run(args.clients, args.seconds, args.children, seed, args.socket)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:24} {value}")
    ok = all(result[k] == 0 for k in INVARIANTS) and result["bench_crashes"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
