"""Chaos soak: handoff cycles against one holder, each killing a client with SIGKILL.

    .venv/bin/python bench/chaos.py [--cycles N] [--json] [--seed S] [--socket PATH]

Set-up. Several sessions (default 4) are in play at once: each is a real bash in a real PTY
printing a numbered line (`L1`, `L2`, ...) every 5 ms (--line-interval). The harness escrows
each one (`hand_off`) and keeps an unread duplicate of every master for itself, so that it
can take a session back into its own custody when a killed client had already taken
ownership of it (see "acked" below). Without --socket it starts its own holder in a
temporary directory.

One cycle. A *victim* client is forked (os.fork, no exec: a cycle costs milliseconds, not a
Python start-up; it closes every inherited fd but its report pipe first). It speaks the raw
protocol step by step (`escrow_client.protocol` and `escrow_client.fdpass` only), reports
each step on the pipe, and stops at the step chosen for it at random: the parent then
SIGKILLs it, after a random pause of 0-2 ms so the holder is caught at different points of
its own work. With `--parallel P`, P victims run in each cycle on distinct sessions and are
killed together; with `--contend X` as well, each may instead go to a session another victim
of the cycle is on (it must then be refused with `busy` or `handed_off`, or come after the
other's handoff was put back; two victims acking one session in a cycle is a duplicate). The
kill points, and how each is judged once the holder has settled (no session `handing_off`):

- `connect`: connected, no `hello` yet. Nothing may change: the session stays `draining`.
- `hello`: `welcome` received, nothing asked. Same: `draining`.
- `retrieve_sent`: `retrieve` sent, the answer not read (the `handoff` and its fd may be
  queued in the dead client's socket, or the holder may still be sweeping). The holder never
  got an ack, so the session must be back in `draining` (or `exited`), never `handed_off`.
- `handoff_received`: the `handoff` and its fd arrived, no `ack`. The victim checks the fd
  first (a terminal, and the same /dev/pts/N as the session) and reports its replay. Again
  no ack: back to `draining`. The replay it saw must continue the harness's record of the
  stream with no gap (it is not counted as delivered: the holder keeps it and replays it
  again).
- `acked`: the victim sent `ack` (and was killed before or after `done`). The app has taken
  ownership: the session must be `handed_off` with exactly the victim's `handoff_id`. The
  victim's copy of the master died with it; that is the app dying after taking ownership,
  not a loss by the holder. The harness stands in for the relaunched app: it appends the
  victim's replay to its record and re-deposits the session from its own duplicate (same id,
  same shell), so the sequence goes on and the session stays in play.

After every cycle: the holder is alive, and every session is `draining` (or `exited`), or
`handed_off` exactly as above. A session in any other state (or stuck in `handing_off`) is
lost; a `handed_off` without the victim's ack, or to another handoff_id, is a duplicate
handoff. Each broken session is counted once and then left out of play. Every
`--check-every` cycles, and at the end, the harness retrieves every session with the real
client, reads some live output, checks that its whole record (every replay and live read
across all cycles) numbers its lines 1, 2, 3, ... with no gap and no repeat, and hands the
session off again. At the end it also compares the holder's count of completed handoffs with
the acks that were sent (a difference is a duplicate), and its open fd count with its
baseline plus one per live session, before and after releasing everything (`fds_leaked`).

Prints one JSON object (`--json`) or a table: cycles, sessions_lost, fds_leaked,
holder_died, duplicate_handoffs, plus sequence_gaps, replay_mismatches, bad_fds, kills per
step, elapsed, and the holder's RSS and fd count before and after. Exit status 0 only when
every invariant counter is 0.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import json
import os
import random
import re
import select
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from holder import BenchHolder, end_shell, read_until, spawn_numbered_shell

from escrow_client import EscrowClient, EscrowError, protocol
from escrow_client.fdpass import recv_frame, send_frame

STEPS = ("connect", "hello", "retrieve_sent", "handoff_received", "acked")
TIOCGPTN = 0x80045430
SESSION_FDS = 3  # a session costs the holder its PTY master, its state file and mmap's dup of it
SETTLE_TIMEOUT = 20.0  # the holder's ack deadline is 10 s; it notices a dead peer at once
INVARIANTS = ("sessions_lost", "fds_leaked", "holder_died", "duplicate_handoffs",
              "sequence_gaps", "replay_mismatches", "bad_fds")


# --- the victim: a raw client that stops where it is told ----------------------------------


def _victim(sock_path: str, owner: str, sid: str, stop_at: str, out: int) -> None:
    """Runs in a forked child; never returns (os._exit). Reports one JSON line per step."""

    def report(step: str, **fields: Any) -> None:
        data = (json.dumps(dict(fields, step=step)) + "\n").encode()
        while data:
            data = data[os.write(out, data):]

    def stop_here(step: str) -> None:
        if step == stop_at:
            time.sleep(60)  # the parent SIGKILLs us; bounded in case it died itself
            os._exit(9)

    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(30)
        sock.connect(sock_path)
        report("connect")
        stop_here("connect")
        send_frame(sock, protocol.encode(protocol.Hello(
            version=protocol.VERSION, owner=owner, client="chaos-victim", timeout=5.0)))
        welcome = protocol.decode_response(recv_frame(sock, 256 << 20)[0])
        assert isinstance(welcome, protocol.Welcome), welcome
        report("hello")
        stop_here("hello")
        send_frame(sock, protocol.encode(protocol.Retrieve(id=sid)))
        report("retrieve_sent")
        stop_here("retrieve_sent")
        body, fds = recv_frame(sock, 256 << 20)
        reply = protocol.decode_response(body)
        protocol.check_fds(reply, len(fds))
        if isinstance(reply, protocol.Error):
            report("error", code=reply.code, message=reply.message)
            os._exit(3)
        assert isinstance(reply, protocol.Handoff), reply
        fd = fds[0]
        try:
            ptn = int.from_bytes(fcntl.ioctl(fd, TIOCGPTN, b"\0\0\0\0"), sys.byteorder)
        except OSError:
            ptn = None
        report("handoff_received", handoff_id=reply.handoff_id, isatty=os.isatty(fd), ptn=ptn,
               replay=base64.b64encode(reply.replay).decode(), dropped=reply.dropped_bytes,
               state=reply.session.state)
        stop_here("handoff_received")
        send_frame(sock, protocol.encode(protocol.Ack(id=sid, handoff_id=reply.handoff_id)))
        report("acked", handoff_id=reply.handoff_id)
        stop_here("acked")
        os._exit(0)
    except BaseException as exc:  # anything at all: report it, never run the parent's code
        with contextlib.suppress(BaseException):
            report("failed", error=repr(exc))
        os._exit(2)


def fork_victim(sock_path: str, owner: str, sid: str, stop_at: str) -> tuple[int, int]:
    """Fork a victim; return (pid, read end of its report pipe)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            for name in os.listdir("/proc/self/fd"):
                fd = int(name)
                if fd > 2 and fd != w:
                    with contextlib.suppress(OSError):
                        os.close(fd)  # the harness's masters and sockets are not the victim's
            _victim(sock_path, owner, sid, stop_at, w)
        finally:
            os._exit(2)
    os.close(w)
    return pid, r


def read_reports(pipe: int, until: str, timeout: float) -> list[dict[str, Any]]:
    """Reports from a victim, up to the one for step `until` (or its end, or a failure)."""
    reports: list[dict[str, Any]] = []
    buf = bytearray()
    deadline = time.monotonic() + timeout
    while True:
        while b"\n" in buf:
            line, _, rest = bytes(buf).partition(b"\n")
            buf = bytearray(rest)
            reports.append(json.loads(line))
            if reports[-1]["step"] in (until, "error", "failed"):
                return reports
        left = deadline - time.monotonic()
        if left <= 0:
            return reports
        ready, _, _ = select.select([pipe], [], [], left)
        if ready:
            chunk = os.read(pipe, 1 << 20)
            if not chunk:
                return reports
            buf += chunk


# --- the record of each session's output ----------------------------------------------------


_LINE = re.compile(rb"L(\d+)")


def complete_lines(data: bytes) -> tuple[list[int], int]:
    """The L-numbers of the complete lines in `data`, and how many bytes they take."""
    end = data.rfind(b"\n") + 1
    numbers = []
    for raw in data[:end].split(b"\n")[:-1]:
        match = _LINE.fullmatch(raw.rstrip(b"\r"))
        numbers.append(int(match.group(1)) if match else -1)
    return numbers, end


def first_break(last: int, numbers: list[int]) -> int | None:
    """Index of the first number that does not follow on from `last`, or None."""
    for index, number in enumerate(numbers):
        if number != last + index + 1:
            return index
    return None


@dataclass
class Tracked:
    sid: str
    master: int  # the harness's own duplicate: never read while the holder has the session
    proc: subprocess.Popen[bytes]
    ptn: int
    record: bytearray = field(default_factory=bytearray)
    checked_to: int = 0  # bytes of `record` whose complete lines are checked
    last_line: int = 0  # the last L-number checked
    lines_checked: int = 0

    def continues(self, more: bytes) -> bool:
        """True if `more` appended to the record would still number its lines with no
        gap and no repeat (checks without appending)."""
        numbers, _ = complete_lines(bytes(self.record[self.checked_to:]) + more)
        return first_break(self.last_line, numbers) is None

    def append_and_check(self, more: bytes) -> int:
        """Append to the record, check the new complete lines; return the breaks found
        (each break is counted once: checking carries on from the line that broke)."""
        self.record += more
        numbers, used = complete_lines(bytes(self.record[self.checked_to:]))
        breaks = 0
        self.lines_checked += len(numbers)
        while (index := first_break(self.last_line, numbers)) is not None:
            breaks += 1
            previous = numbers[index - 1] if index else self.last_line
            print(f"chaos: {self.sid}: after L{previous} came L{numbers[index]} "
                  f"(around: {numbers[max(0, index - 3):index + 3]})", file=sys.stderr)
            self.last_line, numbers = numbers[index], numbers[index + 1:]
        self.last_line += len(numbers)
        self.checked_to += used
        return breaks


def spawn_session(sid: str, line_interval: float) -> Tracked:
    master, proc = spawn_numbered_shell(line_interval)
    ptn = int.from_bytes(fcntl.ioctl(master, TIOCGPTN, b"\0\0\0\0"), sys.byteorder)
    return Tracked(sid, master, proc, ptn)


# --- the harness ------------------------------------------------------------------------------


class Chaos:
    def __init__(self, holder: BenchHolder, sessions: int, seed: int, check_every: int,
                 handoffs_at_start: int, line_interval: float, parallel: int = 1,
                 contend: float = 0.0) -> None:
        self.line_interval = line_interval
        self.contend = contend
        self.refusals: dict[str, int] = {}
        self.broken: set[str] = set()  # sessions counted as lost or wrongly handed off
        self.parallel = max(1, min(parallel, sessions))
        self.holder = holder
        self.handoffs_at_start = handoffs_at_start
        self.rng = random.Random(seed)
        self.check_every = check_every
        self.owner = f"bench.chaos.{os.getpid()}"
        self.client = EscrowClient(self.owner, socket_path=holder.socket)
        self.n_sessions = sessions
        self.sessions: dict[str, Tracked] = {}
        self.counts: dict[str, int] = dict.fromkeys(INVARIANTS, 0)
        self.kills = dict.fromkeys(STEPS, 0)
        self.victim_errors: dict[str, int] = {}
        self.acks_sent = 0  # acked handoffs we know of: victims' and our own
        self.checks = 0
        self.cycles = 0

    # --- helpers -------------------------------------------------------------------------

    def states(self) -> dict[str, Any]:
        return {s.id: s for s in self.client.list()}

    def settled(self) -> dict[str, Any]:
        """The owner's sessions once none is `handing_off` (bounded)."""
        deadline = time.monotonic() + SETTLE_TIMEOUT
        while True:
            infos = self.states()
            if not any(i.state == "handing_off" for i in infos.values()):
                return infos
            if time.monotonic() > deadline:
                return infos
            time.sleep(0.002)

    def lost(self, sid: str, why: str) -> None:
        self.fault(sid, "sessions_lost", f"lost: {why}")

    def fault(self, sid: str, counter: str, why: str) -> None:
        """Count a broken session once, and leave it out of play from now on."""
        if sid not in self.broken:
            self.counts[counter] += 1
            self.broken.add(sid)
        print(f"chaos: cycle {self.cycles}: {sid}: {why}", file=sys.stderr)

    # --- phases --------------------------------------------------------------------------

    def start(self) -> None:
        for i in range(self.n_sessions):
            sess = spawn_session(f"shell-{i}", self.line_interval)
            self.sessions[sess.sid] = sess
            self.client.hand_off(sess.sid, sess.master, child_pid=sess.proc.pid, label="bash")

    def cycle(self) -> None:
        """Fork `parallel` victims, each told where to stop, SIGKILL them all there, then
        judge every session once the holder has settled. Victims go to distinct sessions,
        except that with --contend each may go to a session another victim is already on
        (it should then be refused with `busy` or `handed_off`, or come after)."""
        self.cycles += 1
        names = sorted(set(self.sessions) - self.broken)
        if not names:
            return
        chosen = self.rng.sample(names, min(self.parallel, len(names)))
        for i in range(1, len(chosen)):
            if self.rng.random() < self.contend:
                chosen[i] = self.rng.choice(chosen[:i])
        victims: list[tuple[Tracked, str, int, int]] = []
        outcomes: dict[str, list[tuple[str, dict[str, Any] | None]]] = {}
        try:
            for sid in chosen:
                step = self.rng.choice(STEPS)
                pid, pipe = fork_victim(self.holder.socket, self.owner, sid, step)
                victims.append((self.sessions[sid], step, pid, pipe))
            for sess, step, _, pipe in victims:
                reports = read_reports(pipe, step, 30.0)
                last = reports[-1]["step"] if reports else "nothing"
                if last == step:
                    self.kills[step] += 1
                elif last == "error" and chosen.count(sess.sid) > 1 and reports[-1]["code"] in (
                    "busy", "handed_off"
                ):
                    code = reports[-1]["code"]
                    self.refusals[code] = self.refusals.get(code, 0) + 1
                else:
                    key = reports[-1].get("code", last) if reports else "no_report"
                    self.victim_errors[key] = self.victim_errors.get(key, 0) + 1
                    print(f"chaos: cycle {self.cycles}: the victim on {sess.sid} stopped at "
                          f"{last}, not {step}: {reports[-1] if reports else ''}",
                          file=sys.stderr)
                handoff = next((r for r in reports if r["step"] == "handoff_received"), None)
                if handoff is not None:
                    self.check_victim_handoff(sess, handoff)
                outcomes.setdefault(sess.sid, []).append((last, handoff))
            time.sleep(self.rng.uniform(0, 0.002))
        finally:
            for _, _, pid, pipe in victims:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                os.close(pipe)

        if not self.holder.alive():
            self.counts["holder_died"] = 1
            return
        infos = self.settled()
        for sid, sess in self.sessions.items():
            if sid in self.broken:
                continue
            info = infos.get(sid)
            state = info.state if info is not None else "unknown"
            acked = [h for last, h in outcomes.get(sid, []) if last == "acked" and h]
            steps = [last for last, _ in outcomes.get(sid, [])] or ["none"]
            if len(acked) > 1:
                # Two victims held a handoff of one session at once: two readers.
                self.counts["duplicate_handoffs"] += len(acked) - 1
                print(f"chaos: cycle {self.cycles}: {sid} was handed off and acked by "
                      f"{len(acked)} victims at once", file=sys.stderr)
            if acked:
                ids = {h["handoff_id"]: h for h in acked}
                if info is not None and state == "handed_off" and info.handoff_id in ids:
                    self.acks_sent += 1
                    self.take_back(sess, base64.b64decode(ids[info.handoff_id]["replay"]))
                elif info is not None and state == "handed_off":
                    self.fault(sid, "duplicate_handoffs", f"handed off to {info.handoff_id}, "
                               f"not the acked {sorted(ids)}")
                else:
                    self.lost(sid, f"acked by the victim, but {state}")
                continue
            if state in ("draining", "exited"):
                continue
            if state == "handed_off":
                self.fault(sid, "duplicate_handoffs",
                           f"handed_off with no ack (victim steps {steps})")
            else:
                self.lost(sid, f"state {state} after kills at {steps}")

    def check_victim_handoff(self, sess: Tracked, handoff: dict[str, Any]) -> None:
        """The fd a victim got is the session's terminal, and its replay carries on from
        what the harness has recorded, with no gap."""
        if not handoff["isatty"] or handoff["ptn"] != sess.ptn:
            self.counts["bad_fds"] += 1
            print(f"chaos: cycle {self.cycles}: {sess.sid}: handed a wrong fd: "
                  f"isatty={handoff['isatty']} pts={handoff['ptn']} (want {sess.ptn})",
                  file=sys.stderr)
        replay = base64.b64decode(handoff["replay"])
        if handoff["dropped"] == 0 and not sess.continues(replay):
            self.counts["replay_mismatches"] += 1
            print(f"chaos: cycle {self.cycles}: {sess.sid}: the replay does not continue "
                  f"the record after L{sess.last_line}", file=sys.stderr)

    def take_back(self, sess: Tracked, replay: bytes) -> None:
        """The victim owned the session when it died: stand in for the relaunched app."""
        self.counts["sequence_gaps"] += sess.append_and_check(replay)
        self.client.hand_off(sess.sid, sess.master, child_pid=sess.proc.pid, label="bash")

    def check_all(self) -> None:
        """Retrieve every session with the real client, check its whole record, and hand it
        off again."""
        self.checks += 1
        for sess in self.sessions.values():
            if sess.sid in self.broken:
                continue
            try:
                got = self.client.retrieve(sess.sid)
            except EscrowError as exc:
                self.lost(sess.sid, f"retrieve by the harness failed: {exc!r}")
                continue
            try:
                self.acks_sent += 1
                if not got.confirmed:
                    self.lost(sess.sid, "the harness's retrieve was not confirmed")
                if got.dropped_bytes:
                    print(f"chaos: {sess.sid}: {got.dropped_bytes} B dropped (ring full)",
                          file=sys.stderr)
                live = read_until(got.fd, lambda out: b"\n" in out, 2.0)
                self.counts["sequence_gaps"] += sess.append_and_check(got.replay + live)
                try:
                    self.client.hand_off(sess.sid, got.fd, child_pid=sess.proc.pid,
                                         label="bash")
                except EscrowError as exc:
                    self.lost(sess.sid, f"hand_off by the harness failed: {exc!r}")
            finally:
                os.close(got.fd)

    def finish(self, baseline_fds: int) -> dict[str, Any]:
        """Final checks: handoff count, fds with the sessions live and after release."""
        status = self.holder.admin.status()
        handoffs = status.counters.get("handoffs", 0) - self.handoffs_at_start
        if handoffs > self.acks_sent:
            self.counts["duplicate_handoffs"] += handoffs - self.acks_sent
        if handoffs < self.acks_sent:
            print(f"chaos: the holder counts {handoffs} handoffs, {self.acks_sent} acked",
                  file=sys.stderr)
        live = sum(1 for i in self.states().values() if i.state in protocol.LIVE_STATES)
        with_sessions = self.holder.settled_fds(baseline_fds + SESSION_FDS * live)
        for sid in self.sessions:
            with contextlib.suppress(EscrowError):
                self.client.release(sid)
        after = self.holder.settled_fds(baseline_fds)
        leaked = max(0, with_sessions - (baseline_fds + SESSION_FDS * live), after - baseline_fds)
        self.counts["fds_leaked"] = leaked
        final = self.holder.admin.status()
        return {"handoffs_by_holder": handoffs, "acks_sent": self.acks_sent,
                "fds_with_sessions": with_sessions, "live_sessions_at_end": live,
                "fds_after": after, "rss_after": final.rss_bytes}

    def close(self) -> None:
        for sess in self.sessions.values():
            end_shell(sess.proc, sess.master)


def run(cycles: int, seed: int, socket_path: str | None = None, sessions: int = 4,
        check_every: int = 25, line_interval: float = 0.005,
        holder_log: str | None = None, parallel: int = 1,
        contend: float = 0.0) -> dict[str, Any]:
    started = time.monotonic()
    holder = BenchHolder(socket_path, log_path=holder_log, name="chaos")
    chaos: Chaos | None = None
    try:
        before = holder.admin.status()
        chaos = Chaos(holder, sessions, seed, check_every, before.counters.get("handoffs", 0),
                      line_interval, parallel, contend)
        chaos.start()
        extra: dict[str, Any] = {}
        for n in range(1, cycles + 1):
            chaos.cycle()
            if chaos.counts["holder_died"]:
                break
            if n % check_every == 0 or n == cycles:
                chaos.check_all()
        if chaos.counts["holder_died"]:
            chaos.counts["sessions_lost"] += len(chaos.sessions)
        else:
            extra = chaos.finish(before.open_fds or 0)
        internal = holder.log_count("internal_error")
        result: dict[str, Any] = dict(
            cycles=chaos.cycles, **chaos.counts,
            kills=chaos.kills, victim_errors=chaos.victim_errors, checks=chaos.checks,
            lines_checked=sum(s.lines_checked for s in chaos.sessions.values()),
            sessions=sessions, parallel=chaos.parallel, contend=contend,
            contention_refusals=chaos.refusals, seed=seed,
            elapsed_s=round(time.monotonic() - started, 2),
            rss_before=before.rss_bytes, fds_before=before.open_fds,
            internal_errors_logged=internal, **extra,
        )
        result["cycles_per_s"] = round(chaos.cycles / max(result["elapsed_s"], 1e-9), 1)
        return result
    finally:
        if chaos is not None:
            chaos.close()
        holder.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=200)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--seed", type=int, default=None, help="default: a random one")
    parser.add_argument("--socket", default=None,
                        help="use the holder on this socket (default: start one)")
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--check-every", type=int, default=25, metavar="CYCLES",
                        help="retrieve and check every session this often")
    parser.add_argument("--line-interval", type=float, default=0.005, metavar="SECONDS",
                        help="pause between two numbered lines of each shell")
    parser.add_argument("--parallel", type=int, default=1, metavar="P",
                        help="victims per cycle, each on its own session, killed together")
    parser.add_argument("--contend", type=float, default=0.0, metavar="P",
                        help="with --parallel: chance that a victim goes to a session another "
                        "victim of the same cycle is on")
    parser.add_argument("--holder-log", default=None, metavar="PATH",
                        help="keep the log of the holder this starts (default: discarded)")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 32)
    result = run(args.cycles, seed, args.socket, args.sessions, args.check_every,
                 args.line_interval, args.holder_log, args.parallel, args.contend)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:24} {value}")
    return 0 if all(result[k] == 0 for k in INVARIANTS) else 1


if __name__ == "__main__":
    sys.exit(main())
