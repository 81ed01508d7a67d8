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

With `--kill-holder`, `escrowd` runs as users run it, a keeper and the holder it runs, and
the serving holder (the keeper's child that the pidfile `<socket>.pid` names) is SIGKILLed
at random moments while the cycles go on: a kill is armed every 1 to 2 * `--kill-every` - 1
cycles at random (default 15: about 133 kills in 2,000 cycles) and fires from a thread after
a random delay of up to twice the median cycle, so it lands anywhere: in a victim's
exchange, a sweep, an ack, the settling, the harness's own retrieves and deposits, and in a
holder still adopting. The keeper starts the next holder (with its back-off), which adopts
every session. What changes:
- A victim cut off by the kill is counted (`victims_cut_off`), not an error. One whose ack
  could not be sent settles who owns the fd as the client library does
  (`EscrowClient._resolve`: list on a fresh connection, ack an adopted `handing_off`
  again); the harness's own retrieves are the client library's, which does that itself.
- The harness's deposits run in a short-lived forked process (an app that hands off and
  exits): a deposit the kill cut off may have been stored, and is adopted `held` by a
  custodian that is gone, which drains at once. A deposit that was not stored is made again.
- An acked handoff may come out three ways, each checked: `handed_off` with the victim's
  handoff_id; unknown, when the holder completed it and died (its tombstone went with it:
  the holder's log must name that handoff_id `handed_off`); or `draining` again, when the
  holder died before it read the ack (then the log must not name it handed off, and the
  victim must not have been answered `done`: two readers would be a duplicate handoff).
- Gaps: after an unclean stop a draining session's `replay_gaps` mark where the bytes of
  one read may be missing. Every replay's mark is placed in the record, and a break in the
  numbering within a line of a mark, no longer than one read, is a marked gap (counted,
  `marked_gaps`); any other break is a `sequence_gaps` failure.
- A kill that finds no holder serving (the keeper is between two) waits for the next one and
  hits it early, often while it adopts (`holder_kills_at_its_start`).
- fds: the holder's at the end (baseline + 2 per live session, and back to its baseline
  after release), and the keeper's (its baseline + 2 per live session, the master and the
  state file it stores, and back after release), both in `fds_leaked`.
- The handoffs the holders completed are counted from the holder's log (a killed holder
  takes its counters with it) and compared with the acks.

Prints one JSON object (`--json`) or a table: cycles, sessions_lost, fds_leaked,
holder_died, duplicate_handoffs, plus sequence_gaps, replay_mismatches, bad_fds, kills per
step, elapsed, and the holder's RSS and fd count before and after (with --kill-holder also
holder_kills, kills by phase, marked_gaps and the keeper's fds). Exit status 0 only when
every invariant counter is 0.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import copy
import fcntl
import json
import os
import random
import re
import select
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from holder import BenchHolder, end_shell, read_until, spawn_numbered_shell

from escrow_client import EscrowClient, EscrowError, errors, protocol
from escrow_client.client import Retrieved
from escrow_client.fdpass import recv_frame, send_frame
from escrowd.statefile import MAX_READ

STEPS = ("connect", "hello", "retrieve_sent", "handoff_received", "acked")
TIOCGPTN = 0x80045430
SESSION_FDS = 2  # a session costs the holder its PTY master and its state file
KEEPER_SESSION_FDS = 2  # and the keeper the two it stores: the master and the state file
SETTLE_TIMEOUT = 20.0  # the holder's ack deadline is 10 s; it notices a dead peer at once
# A holder SIGKILLed comes back after the keeper's back-off (at most 5 s) and its start-up.
RECOVER_TIMEOUT = 60.0
CLIENT_TIMEOUT = 30.0  # the harness's and a victim's client: long enough to outlast a restart
INVARIANTS = ("sessions_lost", "fds_leaked", "holder_died", "duplicate_handoffs",
              "sequence_gaps", "replay_mismatches", "bad_fds")
# What a victim's resolution (EscrowClient._resolve) may end in: it kept the fd ("done",
# "ours"), or closed it because the holder kept the session or another client has it.
TOOK_IT = ("done", "ours")

T = TypeVar("T")


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
               state=reply.session.state, gaps=list(reply.session.replay_gaps))
        stop_here("handoff_received")
        try:
            send_frame(sock, protocol.encode(protocol.Ack(id=sid, handoff_id=reply.handoff_id)))
        except OSError as exc:
            # The connection died (with the holder): settle who owns the fd as the client
            # library does, on a fresh connection.
            report("acked", handoff_id=reply.handoff_id, error=repr(exc),
                   resolved=_resolve_as_the_library(sock_path, owner, reply, fd))
            stop_here("acked")
            os._exit(0)
        report("acked", handoff_id=reply.handoff_id)
        stop_here("acked")
        os._exit(0)
    except BaseException as exc:  # anything at all: report it, never run the parent's code
        with contextlib.suppress(BaseException):
            report("failed", error=repr(exc))
        os._exit(2)


def _resolve_as_the_library(sock_path: str, owner: str, reply: protocol.Handoff,
                            fd: int) -> str:
    """`EscrowClient._resolve` for a handoff whose ack could not be sent: "done" (acked
    again and confirmed) or "ours" (the holder has no copy) when the fd is the victim's now,
    else the code of the error it raised after closing the fd (the holder kept the
    session, or another client has it)."""
    client = EscrowClient(owner, socket_path=sock_path, timeout=CLIENT_TIMEOUT,
                          client_name="chaos-victim")
    got = Retrieved(fd, reply.session, reply.replay, reply.dropped_bytes, reply.handoff_id,
                    confirmed=False)
    try:
        result = client._resolve(got)
    except EscrowError as exc:
        return exc.code
    return "done" if result.confirmed else "ours"


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


@dataclass
class Mark:
    """A spot in a record where, by the holder's `replay_gaps`, the bytes of one read may
    be missing. A break in the numbering there is a marked gap: at most two breaks (the
    line the gap cut, and the next), resuming above where it broke, no more than a read."""

    pos: int
    breaks: int = 0
    before: int = 0  # the last number before its first break
    missing: int | None = None  # lines missing, once the numbering resumed above `before`
    judged: bool = False


@dataclass
class LineCheck:
    """Where the check of a record stands: checking goes on from `checked_to`."""

    checked_to: int = 0  # bytes of the record whose complete lines are checked
    last_line: int = 0  # the last L-number checked
    last_start: int = 0  # where that line starts in the record
    lines: int = 0
    marks: list[Mark] = field(default_factory=list)
    pending: list[Mark] = field(default_factory=list)  # marks broken at, not judged yet

    def scan(self, record: bytes | bytearray, sid: str, quiet: bool = False) -> list[str]:
        """Check the complete lines of `record` past `checked_to`; returns one description
        per break not accounted for by a mark (each counted once: checking carries on from
        the line that broke)."""
        data = bytes(record[self.checked_to:])
        end = data.rfind(b"\n") + 1
        problems: list[str] = []
        pos = self.checked_to
        for raw in data[:end].split(b"\n")[:-1]:
            start, pos = pos, pos + len(raw) + 1
            match = _LINE.fullmatch(raw.rstrip(b"\r"))
            number = int(match.group(1)) if match else -1
            self.lines += 1
            if number == self.last_line + 1:
                self._judge_marks(start, problems)
            else:
                mark = next((m for m in self.marks if not m.judged and m.breaks < 2
                             and self.last_start <= m.pos <= pos), None)
                if mark is None:
                    problems.append(f"after L{self.last_line} came {raw[:20]!r}")
                else:
                    if mark.breaks == 0:
                        mark.before = self.last_line
                        self.pending.append(mark)
                    mark.breaks += 1
                    if number > mark.before:
                        missing = number - mark.before - 1
                        mark.missing = missing if mark.missing is None else min(
                            mark.missing, missing)
            self.last_line, self.last_start = number, start
        self.checked_to += end
        if not quiet:
            for problem in problems:
                print(f"chaos: {sid}: {problem}", file=sys.stderr)
        return problems

    def _judge_marks(self, start: int, problems: list[str]) -> None:
        """The numbering runs on again at `start`: every mark it broke at is behind us."""
        if not self.pending:
            return
        for mark in [m for m in self.pending if m.pos < start]:
            self.pending.remove(mark)
            mark.judged = True
            if mark.missing is None:
                problems.append(f"at a marked gap after L{mark.before}, the numbering went back")
            elif mark.missing * len(f"L{mark.before}\r\n") > MAX_READ + 16:
                problems.append(f"a marked gap after L{mark.before} of {mark.missing} lines: "
                                "more than one read")

    def marked_gaps(self) -> list[int]:
        """Lines missing at each mark where the numbering really broke."""
        return [m.missing or 0 for m in self.marks if m.breaks]


@dataclass
class Tracked:
    sid: str
    master: int  # the harness's own duplicate: never read while the holder has the session
    proc: subprocess.Popen[bytes]
    ptn: int
    record: bytearray = field(default_factory=bytearray)
    check: LineCheck = field(default_factory=LineCheck)
    gap_marks: int = 0  # replays that came with replay_gaps

    @property
    def last_line(self) -> int:
        return self.check.last_line

    @property
    def lines_checked(self) -> int:
        return self.check.lines

    def _mark(self, check: LineCheck, gaps: list[int] | None) -> None:
        for gap_at in gaps or []:
            check.marks.append(Mark(len(self.record) + gap_at))

    def continues(self, more: bytes, gaps: list[int] | None = None) -> bool:
        """True if `more` (a replay marked at `gap_at`, if at all) appended to the record
        would still number its lines with no gap but marked ones, and no repeat (checks
        without appending)."""
        probe = copy.deepcopy(self.check)
        self._mark(probe, gaps)
        return not probe.scan(self.record + more, self.sid, quiet=True)

    def append_and_check(self, more: bytes, gaps: list[int] | None = None) -> int:
        """Append to the record (a replay marked at `gap_at`, if at all), check the new
        complete lines; return the breaks found that no mark accounts for."""
        if gaps:
            self.gap_marks += 1
        self._mark(self.check, gaps)
        self.record += more
        return len(self.check.scan(self.record, self.sid))


def spawn_session(sid: str, line_interval: float) -> Tracked:
    master, proc = spawn_numbered_shell(line_interval)
    ptn = int.from_bytes(fcntl.ioctl(master, TIOCGPTN, b"\0\0\0\0"), sys.byteorder)
    return Tracked(sid, master, proc, ptn)


# --- the holder's SIGKILL -------------------------------------------------------------------


class HolderKiller:
    """SIGKILLs the serving holder from a thread, once per `arm`, when its delay is up (or,
    if no holder serves then, as soon as the keeper's next one does). `phase` is what the
    harness was doing, set by the harness; each kill is counted under the phase it hit."""

    def __init__(self, holder: BenchHolder) -> None:
        self.holder = holder
        self.kills = 0
        self.at_start = 0  # kills that found no holder serving, and hit the next one early
        self.by_phase: dict[str, int] = {}
        self.phase = "start"
        self._due: float | None = None
        self._stopped = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="holder-killer", daemon=True)
        self._thread.start()

    @property
    def armed(self) -> bool:
        return self._due is not None

    def arm(self, delay: float) -> None:
        with self._cond:
            if self._due is None:
                self._due = time.monotonic() + delay
                self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join()

    def _run(self) -> None:
        waited = False
        while True:
            with self._cond:
                while not self._stopped and (
                    self._due is None or time.monotonic() < self._due
                ):
                    wait = None if self._due is None else self._due - time.monotonic()
                    self._cond.wait(wait)
                if self._stopped:
                    return
            if self.holder.kill_serving() is None:
                waited = True
                time.sleep(0.002)  # between two holders: the next one is coming
                continue
            with self._cond:
                self.at_start += waited
                waited = False
                self.kills += 1
                self.by_phase[self.phase] = self.by_phase.get(self.phase, 0) + 1
                self._due = None


# --- the harness ------------------------------------------------------------------------------


class Chaos:
    def __init__(self, holder: BenchHolder, sessions: int, seed: int, check_every: int,
                 handoffs_at_start: int, line_interval: float, parallel: int = 1,
                 contend: float = 0.0, kill_every: int | None = None,
                 settle_timeout: float = SETTLE_TIMEOUT) -> None:
        self.line_interval = line_interval
        self.contend = contend
        self.refusals: dict[str, int] = {}
        self.broken: set[str] = set()  # sessions counted as lost or wrongly handed off
        self.parallel = max(1, min(parallel, sessions))
        self.holder = holder
        self.handoffs_at_start = handoffs_at_start
        self.rng = random.Random(seed)
        self.check_every = check_every
        self.settle_timeout = settle_timeout
        self.owner = f"bench.chaos.{os.getpid()}"
        self.client = EscrowClient(self.owner, socket_path=holder.socket,
                                   timeout=CLIENT_TIMEOUT)
        self.n_sessions = sessions
        self.sessions: dict[str, Tracked] = {}
        self.counts: dict[str, int] = dict.fromkeys(INVARIANTS, 0)
        self.kills = dict.fromkeys(STEPS, 0)
        self.victim_errors: dict[str, int] = {}
        self.acks_sent = 0  # acked handoffs we know of: victims' and our own
        self.checks = 0
        self.cycles = 0
        # --kill-holder
        self.kill_every = kill_every
        self.killer = HolderKiller(holder) if kill_every else None
        self.next_kill = self.rng.randint(1, 2 * kill_every - 1) if kill_every else 0
        self.durations: deque[float] = deque(maxlen=50)
        self.kills_judged = 0  # the killer's count when the last cycle was judged
        self.killed_before = False  # a kill in the window judged last
        self.cut_off: dict[str, int] = {}  # victims whose connection died, by last step
        self.outcomes: dict[str, int] = {}  # how acked handoffs and deposits came out
        self.retries: dict[str, int] = {}  # harness calls asked again after a kill
        self.cycle_started = time.monotonic()

    # --- helpers -------------------------------------------------------------------------

    def count(self, table: dict[str, int], key: str) -> None:
        table[key] = table.get(key, 0) + 1

    def phase(self, name: str) -> None:
        if self.killer is not None:
            self.killer.phase = name

    def ask(self, what: str, call: Callable[[], T]) -> T:
        """`call()`; with --kill-holder, asked again while the holder restarts."""
        deadline = time.monotonic() + RECOVER_TIMEOUT
        while True:
            try:
                return call()
            except (errors.HolderUnavailable, errors.HolderUnresponsive):
                if (self.killer is None or time.monotonic() > deadline
                        or not self.holder.alive()):
                    raise
                self.count(self.retries, what)
                time.sleep(0.01)

    def states(self) -> dict[str, Any]:
        return {s.id: s for s in self.ask("list", self.client.list)}

    def settled(self) -> dict[str, Any]:
        """The owner's sessions once none is `handing_off` or `held` (bounded)."""
        deadline = time.monotonic() + self.settle_timeout
        while True:
            infos = self.states()
            if not any(i.state in ("handing_off", "held") for i in infos.values()):
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

    def logged_handed_off(self, handoff_id: str) -> bool:
        """A holder's log says the handoff `handoff_id` completed (`handed_off`): the one
        that completed it, or the next one, which found it recorded so (a kill may fall
        between the record and its log line)."""
        if self.holder.log_path is None:
            return False
        with open(self.holder.log_path, errors="replace") as log:
            return any(" state=handed_off " in line and f"handoff_id={handoff_id}" in line
                       for line in log)

    def kills_since_judged(self) -> bool:
        return self.killer is not None and self.killer.kills != self.kills_judged

    # --- phases --------------------------------------------------------------------------

    def start(self) -> None:
        for i in range(self.n_sessions):
            sess = spawn_session(f"shell-{i}", self.line_interval)
            self.sessions[sess.sid] = sess
            self.client.hand_off(sess.sid, sess.master, child_pid=sess.proc.pid, label="bash")

    def maybe_arm(self) -> None:
        """With --kill-holder: every 1 to 2 * kill_every - 1 cycles (at random), arm a kill
        to fire after a random delay of up to twice the median cycle (so it may land in the
        next one)."""
        if self.killer is None or self.kill_every is None or self.cycles < self.next_kill:
            return
        if self.killer.armed:
            return  # the last one has not fired yet (no holder serves): next cycle
        self.next_kill = self.cycles + self.rng.randint(1, 2 * self.kill_every - 1)
        typical = statistics.median(self.durations) if self.durations else 0.02
        self.killer.arm(self.rng.uniform(0, 2 * typical))

    def cycle(self) -> None:
        """Fork `parallel` victims, each told where to stop, SIGKILL them all there, then
        judge every session once the holder has settled. Victims go to distinct sessions,
        except that with --contend each may go to a session another victim is already on
        (it should then be refused with `busy` or `handed_off`, or come after)."""
        self.cycles += 1
        self.cycle_started = time.monotonic()
        names = sorted(set(self.sessions) - self.broken)
        if not names:
            return
        self.maybe_arm()
        self.phase("victims")
        chosen = self.rng.sample(names, min(self.parallel, len(names)))
        for i in range(1, len(chosen)):
            if self.rng.random() < self.contend:
                chosen[i] = self.rng.choice(chosen[:i])
        victims: list[tuple[Tracked, str, int, int]] = []
        outcomes: dict[str, list[tuple[str, dict[str, Any] | None, dict[str, Any]]]] = {}
        try:
            for sid in chosen:
                step = self.rng.choice(STEPS)
                pid, pipe = fork_victim(self.holder.socket, self.owner, sid, step)
                victims.append((self.sessions[sid], step, pid, pipe))
            for sess, step, _, pipe in victims:
                reports = read_reports(pipe, step, 30.0 + RECOVER_TIMEOUT)
                last = reports[-1]["step"] if reports else "nothing"
                if last == step:
                    self.kills[step] += 1
                elif last == "error" and chosen.count(sess.sid) > 1 and reports[-1]["code"] in (
                    "busy", "handed_off"
                ):
                    code = reports[-1]["code"]
                    self.refusals[code] = self.refusals.get(code, 0) + 1
                elif last in ("failed", "error") and self.kills_since_judged():
                    # Its connection died with the holder (or it met the next holder's
                    # adopted handoff): what it reached is judged below all the same.
                    reached = reports[-2]["step"] if len(reports) > 1 else "nothing"
                    self.count(self.cut_off, reached if last == "failed" else
                               f"refused_{reports[-1].get('code')}")
                else:
                    key = reports[-1].get("code", last) if reports else "no_report"
                    self.victim_errors[key] = self.victim_errors.get(key, 0) + 1
                    print(f"chaos: cycle {self.cycles}: the victim on {sess.sid} stopped at "
                          f"{last}, not {step}: {reports[-1] if reports else ''}",
                          file=sys.stderr)
                handoff = next((r for r in reports if r["step"] == "handoff_received"), None)
                if handoff is not None:
                    self.check_victim_handoff(sess, handoff)
                acked = reports[-1] if last == "acked" else {}
                outcomes.setdefault(sess.sid, []).append((last, handoff, acked))
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
        self.phase("settle")
        infos = self.settled()
        # Leniency for a holder's death applies to a kill since the last judgment, or in the
        # window before it (a kill right after a judgment can still show in this cycle).
        killed_now = self.kills_since_judged()
        killed = killed_now or self.killed_before
        if self.killer is not None:
            self.killed_before, self.kills_judged = killed_now, self.killer.kills
        self.phase("judge")
        for sid, sess in self.sessions.items():
            if sid in self.broken:
                continue
            info = infos.get(sid)
            state = info.state if info is not None else "unknown"
            acked = [(h, a) for last, h, a in outcomes.get(sid, []) if last == "acked" and h]
            steps = [last for last, _, _ in outcomes.get(sid, [])] or ["none"]
            if len(acked) > 1:
                # Two victims held a handoff of one session at once: two readers.
                self.counts["duplicate_handoffs"] += len(acked) - 1
                print(f"chaos: cycle {self.cycles}: {sid} was handed off and acked by "
                      f"{len(acked)} victims at once", file=sys.stderr)
            if acked:
                self.judge_ack(sess, info, acked, killed)
                continue
            if state in ("draining", "exited"):
                continue
            if state == "handed_off":
                self.fault(sid, "duplicate_handoffs",
                           f"handed_off with no ack (victim steps {steps})")
            else:
                self.lost(sid, f"state {state} after kills at {steps}")
        self.durations.append(time.monotonic() - self.cycle_started)

    def judge_ack(self, sess: Tracked, info: Any, acked: list[tuple[dict[str, Any],
                  dict[str, Any]]], killed: bool) -> None:
        """A victim acked a handoff of `sess` (and was killed). Who owns the session now?"""
        sid = sess.sid
        state = info.state if info is not None else "unknown"
        ids = {h["handoff_id"]: (h, a) for h, a in acked}
        resolved = {a.get("resolved") for _, a in acked}
        took = any(r is None or r in TOOK_IT for r in resolved)  # a victim kept its fd
        if info is not None and state == "handed_off" and info.handoff_id in ids:
            handoff, ack = ids[info.handoff_id]
            if ack.get("resolved") not in (None, *TOOK_IT):
                self.fault(sid, "duplicate_handoffs", f"handed off to a victim told "
                           f"{ack['resolved']!r}, which closed its copy")
                return
            self.acks_sent += 1
            self.take_back(sess, handoff)
            return
        if info is not None and state == "handed_off":
            self.fault(sid, "duplicate_handoffs", f"handed off to {info.handoff_id}, "
                       f"not the acked {sorted(ids)}")
            return
        if not killed:
            self.lost(sid, f"acked by the victim, but {state}")
            return
        done = [h for hid, (h, _) in ids.items() if self.logged_handed_off(hid)]
        if state == "unknown":
            # The holder completed the handoff and died: its tombstone went with it.
            if done and took:
                self.count(self.outcomes, "handed_off_tombstone_lost")
                self.acks_sent += 1
                self.take_back(sess, done[0])
            else:
                self.lost(sid, "acked by the victim and unknown to the next holder, but no "
                          "holder logged that handoff as completed")
            return
        if state in ("draining", "exited"):
            # The holder died before it read the ack: the next one adopted the handoff and,
            # with no ack for it, drains again. Nobody else may hold the fd.
            if done:
                self.fault(sid, "duplicate_handoffs", f"{state} again although a holder "
                           "logged the acked handoff as completed: two readers")
            elif resolved & set(TOOK_IT):
                self.fault(sid, "duplicate_handoffs", f"{state} again although the victim "
                           f"was told {sorted(r for r in resolved if r)}: two readers")
            else:
                self.count(self.outcomes, "ack_died_with_holder")
            return
        self.lost(sid, f"acked by the victim, but {state} after the holder's death")

    def check_victim_handoff(self, sess: Tracked, handoff: dict[str, Any]) -> None:
        """The fd a victim got is the session's terminal, and its replay carries on from
        what the harness has recorded, with no gap but a marked one."""
        if not handoff["isatty"] or handoff["ptn"] != sess.ptn:
            self.counts["bad_fds"] += 1
            print(f"chaos: cycle {self.cycles}: {sess.sid}: handed a wrong fd: "
                  f"isatty={handoff['isatty']} pts={handoff['ptn']} (want {sess.ptn})",
                  file=sys.stderr)
        replay = base64.b64decode(handoff["replay"])
        if handoff["dropped"] == 0 and not sess.continues(replay, handoff.get("gaps")):
            self.counts["replay_mismatches"] += 1
            print(f"chaos: cycle {self.cycles}: {sess.sid}: the replay does not continue "
                  f"the record after L{sess.last_line}", file=sys.stderr)

    def take_back(self, sess: Tracked, handoff: dict[str, Any]) -> None:
        """The victim owned the session when it died: stand in for the relaunched app."""
        self.phase("take_back")
        replay = base64.b64decode(handoff["replay"])
        self.counts["sequence_gaps"] += sess.append_and_check(replay, handoff.get("gaps"))
        self.deposit(sess, sess.master)

    def deposit(self, sess: Tracked, fd: int) -> None:
        """Hand `fd` off as session `sess` (escrowed and draining when this returns). With
        --kill-holder, from a forked process that exits after, as an app that hands off and
        exits: if the holder dies under it, a deposit that was stored is adopted `held` by
        a custodian that is gone (and drains), and one that was not is made again."""
        if self.killer is None:
            self.client.hand_off(sess.sid, fd, child_pid=sess.proc.pid, label="bash")
            return
        deadline = time.monotonic() + RECOVER_TIMEOUT
        while True:
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the child
                code = 1
                try:
                    EscrowClient(self.owner, socket_path=self.holder.socket,
                                 timeout=CLIENT_TIMEOUT).hand_off(
                        sess.sid, fd, child_pid=sess.proc.pid, label="bash")
                    code = 0
                except (errors.HolderUnavailable, errors.HolderUnresponsive):
                    code = 3
                except BaseException:
                    code = 4
                finally:
                    os._exit(code)
            _, status = os.waitpid(pid, 0)
            code = os.waitstatus_to_exitcode(status)
            if code == 0:
                return
            info = self.states().get(sess.sid)
            if info is not None and info.state in ("held", "draining", "exited"):
                self.count(self.outcomes, f"deposit_cut_off_but_stored_{info.state}")
                return
            if code != 3 or time.monotonic() > deadline:
                self.lost(sess.sid, f"the harness's hand_off failed (exit {code}) and the "
                          f"session is {info.state if info else 'unknown'}")
                return
            self.count(self.outcomes, "deposit_cut_off_made_again")

    def take(self, sess: Tracked) -> Retrieved | None:
        """Retrieve `sess` with the client library; with --kill-holder, again after a
        retrieve the holder's death cut off (the library has settled who has the fd)."""
        deadline = time.monotonic() + RECOVER_TIMEOUT + self.settle_timeout
        while True:
            try:
                return self.client.retrieve(sess.sid)
            except (errors.HolderUnavailable, errors.HolderUnresponsive, errors.Busy,
                    errors.AckLate) as exc:
                if self.killer is None or time.monotonic() > deadline:
                    self.lost(sess.sid, f"retrieve by the harness failed: {exc!r}")
                    return None
                self.count(self.retries, f"retrieve_{exc.code}")
                time.sleep(0.01)
            except EscrowError as exc:
                self.lost(sess.sid, f"retrieve by the harness failed: {exc!r}")
                return None

    def check_all(self) -> None:
        """Retrieve every session with the real client, check its whole record, and hand it
        off again."""
        self.checks += 1
        self.phase("check")
        for sess in self.sessions.values():
            if sess.sid in self.broken:
                continue
            got = self.take(sess)
            if got is None:
                continue
            try:
                self.acks_sent += 1
                if not got.confirmed:
                    # The library keeps an unconfirmed fd only when the holder has no copy
                    # left: with --kill-holder, a handoff completed by a holder that died.
                    info = self.states().get(sess.sid) if self.killer else None
                    if self.killer is None:
                        self.lost(sess.sid, "the harness's retrieve was not confirmed")
                    elif info is not None and info.state != "handed_off":
                        self.fault(sess.sid, "duplicate_handoffs", "the harness was given an "
                                   f"unconfirmed fd of a session still {info.state}")
                        continue
                    else:
                        self.count(self.outcomes, "harness_retrieve_tombstone_lost")
                if got.dropped_bytes:
                    print(f"chaos: {sess.sid}: {got.dropped_bytes} B dropped (ring full)",
                          file=sys.stderr)
                live = read_until(got.fd, lambda out: b"\n" in out, 2.0)
                self.counts["sequence_gaps"] += sess.append_and_check(
                    got.replay, list(got.session.replay_gaps))
                self.counts["sequence_gaps"] += sess.append_and_check(live)
                try:
                    self.deposit(sess, got.fd)
                except EscrowError as exc:
                    self.lost(sess.sid, f"hand_off by the harness failed: {exc!r}")
            finally:
                os.close(got.fd)
            self.phase("check")

    def finish(self, baseline_fds: int, keeper_baseline: int | None) -> dict[str, Any]:
        """Final checks: handoff count, fds with the sessions live and after release."""
        status = self.ask("status", self.client.status)  # a holder serves again, if killed
        if self.killer is None:
            handoffs = status.counters.get("handoffs", 0) - self.handoffs_at_start
        else:  # every holder's, from the log: a killed holder takes its counters with it
            with open(self.holder.log_path or os.devnull, errors="replace") as log:
                handoffs = sum(1 for line in log
                               if " event=state " in line and " state=handed_off " in line)
        if handoffs > self.acks_sent:
            self.counts["duplicate_handoffs"] += handoffs - self.acks_sent
        if handoffs < self.acks_sent:
            print(f"chaos: the holder counts {handoffs} handoffs, {self.acks_sent} acked",
                  file=sys.stderr)
        live = sum(1 for i in self.states().values() if i.state in protocol.LIVE_STATES)
        with_sessions = self.holder.settled_fds(baseline_fds + SESSION_FDS * live)
        keeper_want = (keeper_baseline or 0) + KEEPER_SESSION_FDS * live
        keeper_with = self.settled_keeper_fds(keeper_want)
        for sid in self.sessions:
            with contextlib.suppress(EscrowError):
                self.client.release(sid)
        after = self.holder.settled_fds(baseline_fds)
        keeper_after = self.settled_keeper_fds(keeper_baseline or 0)
        leaked = max(0, with_sessions - (baseline_fds + SESSION_FDS * live), after - baseline_fds)
        if keeper_baseline is not None and keeper_with is not None and keeper_after is not None:
            leaked += max(0, keeper_with - keeper_want, keeper_after - keeper_baseline)
        self.counts["fds_leaked"] = leaked
        final = self.holder.admin.status()
        extra: dict[str, Any] = {}
        if self.killer is not None:
            extra = {"keeper_fds_before": keeper_baseline, "keeper_fds_with_sessions":
                     keeper_with, "keeper_fds_after": keeper_after,
                     "unclean_restarts": final.unclean_restarts, "restarts": final.restarts}
        return {"handoffs_by_holder": handoffs, "acks_sent": self.acks_sent,
                "fds_with_sessions": with_sessions, "live_sessions_at_end": live,
                "fds_after": after, "rss_after": final.rss_bytes, **extra}

    def settled_keeper_fds(self, want: int, timeout: float = 5.0) -> int | None:
        """The keeper's fd count, once it equals `want` or after `timeout`."""
        if self.killer is None:
            return None
        deadline = time.monotonic() + timeout
        while True:
            count = self.holder.keeper_fds()
            if count == want or time.monotonic() > deadline:
                return count
            time.sleep(0.01)

    def close(self) -> None:
        if self.killer is not None:
            self.killer.stop()
        for sess in self.sessions.values():
            end_shell(sess.proc, sess.master)


def run(cycles: int, seed: int, socket_path: str | None = None, sessions: int = 4,
        check_every: int = 25, line_interval: float = 0.005,
        holder_log: str | None = None, parallel: int = 1,
        contend: float = 0.0, kill_every: int | None = None,
        ack_deadline: float | None = None) -> dict[str, Any]:
    started = time.monotonic()
    args = [] if ack_deadline is None else ["--ack-deadline", f"{ack_deadline:g}"]
    holder = BenchHolder(socket_path, args=args, log_path=holder_log, name="chaos",
                         keeper=kill_every is not None)
    chaos: Chaos | None = None
    try:
        before = holder.admin.status()
        keeper_before = holder.keeper_fds() if kill_every else None
        settle = SETTLE_TIMEOUT + max(0.0, (ack_deadline or 10.0) - 10.0) + (
            RECOVER_TIMEOUT if kill_every else 0.0)
        chaos = Chaos(holder, sessions, seed, check_every, before.counters.get("handoffs", 0),
                      line_interval, parallel, contend, kill_every, settle)
        chaos.start()
        extra: dict[str, Any] = {}
        try:
            for n in range(1, cycles + 1):
                chaos.cycle()
                if chaos.counts["holder_died"]:
                    break
                if n % check_every == 0 or n == cycles:
                    chaos.check_all()
            if chaos.killer is not None:
                chaos.killer.stop()
                chaos.phase("finish")
        except (errors.HolderUnavailable, errors.HolderUnresponsive) as exc:
            if chaos.killer is None:
                raise
            print(f"chaos: the holder did not come back: {exc!r}", file=sys.stderr)
            chaos.counts["holder_died"] = 1
        if chaos.counts["holder_died"]:
            chaos.counts["sessions_lost"] += len(chaos.sessions)
        else:
            extra = chaos.finish(before.open_fds or 0, keeper_before)
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
        if chaos.killer is not None:
            gaps = [g for s in chaos.sessions.values() for g in s.check.marked_gaps()]
            result.update(
                holder_kills=chaos.killer.kills, holder_kills_by_phase=chaos.killer.by_phase,
                holder_kills_at_its_start=chaos.killer.at_start,
                kill_every=kill_every, ack_deadline=ack_deadline,
                gap_marks=sum(s.gap_marks for s in chaos.sessions.values()),
                marked_gaps=len(gaps), marked_gap_lines_max=max(gaps, default=0),
                victims_cut_off=chaos.cut_off, outcomes=chaos.outcomes,
                retries=chaos.retries,
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
    parser.add_argument("--kill-holder", action="store_true",
                        help="run the keeper and its holder, and SIGKILL the serving holder "
                        "at random moments")
    parser.add_argument("--kill-every", type=int, default=15, metavar="CYCLES",
                        help="with --kill-holder: one kill per this many cycles, on average "
                        "(each after 1 to twice this less one cycles, at random)")
    parser.add_argument("--ack-deadline", type=float, default=None, metavar="SECONDS",
                        help="the holder's --ack-deadline (how long an adopted handoff waits "
                        "for its ack); default: the holder's own")
    args = parser.parse_args(argv)
    if args.kill_every < 1:
        parser.error("--kill-every must be at least 1")
    if args.kill_holder and args.socket is not None:
        parser.error("--kill-holder starts its own keeper and holder: no --socket")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 32)
    result = run(args.cycles, seed, args.socket, args.sessions, args.check_every,
                 args.line_interval, args.holder_log, args.parallel, args.contend,
                 args.kill_every if args.kill_holder else None, args.ack_deadline)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:24} {value}")
    return 0 if all(result[k] == 0 for k in INVARIANTS) else 1


if __name__ == "__main__":
    sys.exit(main())
