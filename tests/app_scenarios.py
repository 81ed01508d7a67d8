"""The scenarios of a terminal app's life, run the same with an app in any language.

An app that keeps the scenario contract (`term-app --socket PATH --owner OWNER --out DIR
[--new ID]...`: client/c/examples/term-app.c is one) reclaims its sessions at launch into a
custody with a journal, creates the ones it was asked for that did not come back, and
shows each one: DIR/<id>.<pid>.out is what that run showed of the session (its replay, then
every byte it read), and DIR/events what happened to it, one JSON line each, written whole.
Here it is started from its command line, as users start it, under a real holder under a
real keeper, with real shells, and crashed with real SIGKILLs: the app's crash, a second
crash right after the reclaim, the holder's crash under the app, the loss of holder and
keeper together, a ring that overflowed, a second instance launched while the first runs.
After each, what every run showed of a session must be the shell's numbered lines, each
once, in order: from L1 wherever the journal reached back to the first line.

Each scenario is a function of an `Apps` (how to start the app under test) and a
`Holders` (how to start a holder), named as a test and taking fixtures: a test module per
app imports the six (`from app_scenarios import *`) and defines the `apps` fixture that
starts its app, so that each is collected there under its own name
(tests/test_c_app.py::test_a_crashed_app_..., the same in test_py_app.py and
test_node_app.py) and every app goes through the same steps.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hostile import numbered_lines
from test_survive import kill_serving_holder

from conftest import OWNER, HolderProcess, fd_count, start_holder, wait_for
from escrow_client import paths

# What an app's module takes with `from app_scenarios import *`: the six scenarios.
__all__ = [
    "test_a_crashed_app_reclaims_every_session_from_its_first_line",
    "test_a_second_crash_right_after_the_reclaim_loses_nothing",
    "test_the_holders_crash_under_the_app_is_taken_back_by_the_app",
    "test_after_a_total_loss_the_app_deposits_again",
    "test_a_ring_that_overflowed_replays_from_a_clean_start",
    "test_a_second_instance_takes_nothing_from_the_first",
]

IDS = ("s1", "s2")
# A relaunch reclaims within its 8 s deadline (custody_held retried for a 1 s grace);
# a loaded machine gets room beyond it.
REACT = 30.0
# Lines a run shows before it is crashed: enough that a replay from L1 is the journal's.
SHOWN = 20
# Output far beyond a 16 KiB ring at once, then the usual pace.
RING_BYTES = 16384
BURST = "i=0; while :; do i=$((i+1)); echo L$i; [ $i -gt 6000 ] && sleep 0.02; done"

Holders = Callable[..., HolderProcess]


@dataclass
class Run:
    """One run of the app: its process, and what it wrote."""

    proc: subprocess.Popen[bytes]
    out: Path
    children: list[int]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def events(self) -> list[dict[str, Any]]:
        """This run's events: those after its `started` (runs that share DIR follow each
        other; runs at once are given a DIR each)."""
        try:
            lines = (self.out / "events").read_bytes().splitlines()
        except FileNotFoundError:
            return []
        mine: list[dict[str, Any]] = []
        inside = False
        for line in lines:
            event = json.loads(line)
            if event["event"] == "started":
                inside = event["pid"] == self.pid
            elif inside:
                mine.append(event)
        return mine

    def wait_event(self, name: str, count: int = 1, timeout: float = REACT) -> dict[str, Any]:
        """The `count`th event `name` of this run, once it came."""
        def seen() -> dict[str, Any] | None:
            assert self.proc.poll() is None, f"the app exited with {self.proc.returncode}: " \
                f"{self.stderr()}"
            found = [e for e in self.events() if e["event"] == name]
            for event in found:
                if event["event"] == "created":
                    self._child(int(event["child_pid"]))
            return found[count - 1] if len(found) >= count else None

        event: dict[str, Any] = wait_for(seen, timeout, f"event {name} #{count} of {self.pid}")
        return event

    def _child(self, pid: int) -> None:
        if pid not in self.children:
            self.children.append(pid)

    def shown(self, sid: str) -> bytes:
        try:
            return (self.out / f"{sid}.{self.pid}.out").read_bytes()
        except FileNotFoundError:
            return b""

    def wait_lines(self, sid: str, at_least: int, timeout: float = REACT) -> list[int]:
        """The numbered lines this run showed of `sid`, once there are `at_least`."""
        def enough() -> list[int] | None:
            assert self.proc.poll() is None, f"the app exited with {self.proc.returncode}"
            numbers = numbered_lines(self.shown(sid))
            return numbers if len(numbers) >= at_least else None

        numbers: list[int] = wait_for(enough, timeout, f"{at_least} lines of {sid} shown")
        return numbers

    def fds(self) -> int:
        return fd_count(self.pid)

    def crash(self) -> None:
        """SIGKILL: its shells live on, escrowed."""
        self.proc.kill()
        self.proc.wait()

    def terminate(self) -> None:
        """SIGTERM: it ends custody and exits 0 (the C app: with no fd left open)."""
        self.proc.send_signal(signal.SIGTERM)
        status = self.proc.wait(REACT)
        assert status == 0, f"the app exited with {status} at SIGTERM: {self.stderr()}"

    def stderr(self) -> str:
        path = self.out / f"stderr.{self.pid}"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""


@dataclass
class Apps:
    """Starts the app under test: `command` is its command line without the contract's
    arguments; `env` is added to the environment of every run."""

    command: Sequence[str]
    env: Mapping[str, str] = field(default_factory=dict)
    runs: list[Run] = field(default_factory=list)

    def launch(self, holder: HolderProcess, out: Path, new: Sequence[str] = IDS,
               env: Mapping[str, str] | None = None) -> Run:
        out.mkdir(parents=True, exist_ok=True)
        argv = [*self.command, "--socket", holder.socket, "--owner", OWNER, "--out", str(out)]
        for sid in new:
            argv += ["--new", sid]
        # stderr to a file: a pipe nobody reads could fill and stop the app.
        err = open(out / "stderr.tmp", "wb")  # noqa: SIM115 (renamed by pid below)
        with err:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=err, stderr=err,
                                    env={**os.environ, **self.env, **(env or {})})
        os.replace(out / "stderr.tmp", out / f"stderr.{proc.pid}")
        run = Run(proc, out, [])
        self.runs.append(run)
        wait_for(lambda: any(e.get("pid") == proc.pid for e in _all_events(out))
                 or proc.poll() is not None, REACT, "the app to start")
        return run

    def end_all(self) -> None:
        children = {pid for run in self.runs for pid in run.children}
        for run in self.runs:
            if run.proc.poll() is None:
                run.crash()
            children.update(int(e["child_pid"]) for e in run.events()
                            if e["event"] == "created")
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _all_events(out: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in (out / "events").read_bytes().splitlines()]
    except FileNotFoundError:
        return []


def ending(apps: Apps) -> Iterator[Apps]:
    """For a fixture: every run still going is killed, and every shell, at teardown."""
    try:
        yield apps
    finally:
        apps.end_all()


# --- what a run showed ------------------------------------------------------------------------


def gap_free(data: bytes, first: int | None = 1) -> list[int]:
    """The numbered lines of `data`, each once, in order, from L`first` (None: from
    wherever they start)."""
    numbers = numbered_lines(data)
    assert numbers, "no complete line shown"
    start = numbers[0] if first is None else first
    assert numbers == list(range(start, start + len(numbers))), (
        f"a gap or a repeat: {_first_break(numbers, start)}")
    return numbers


def _first_break(numbers: list[int], start: int) -> str:
    for at, (want, got) in enumerate(zip(range(start, start + len(numbers)), numbers,
                                         strict=False)):
        if want != got:
            around = numbers[max(0, at - 2):at + 3]
            return f"line {at}: L{want} expected, L{got} shown (around {around})"
    return "none"


def held_by(holder: HolderProcess, pid: int, ids: Sequence[str] = IDS) -> bool:
    try:
        held = {s.id for s in holder.client().list()
                if s.state == "held" and s.custodian_pid == pid}
    except Exception:
        return False
    return held == set(ids)


def reclaimed(run: Run, retrieved: Sequence[str] = IDS) -> dict[str, Any]:
    event = run.wait_event("reclaimed")
    assert sorted(event["retrieved"]) == sorted(retrieved) and event["failed"] == {}, event
    return event


def first_run(apps: Apps, holder: HolderProcess, out: Path) -> Run:
    """A first launch: nothing to reclaim, s1 and s2 created, each shown from L1."""
    run = apps.launch(holder, out)
    assert reclaimed(run, [])["adopted"] == 0
    for n in range(1, len(IDS) + 1):
        assert run.wait_event("created", n)["journal"] is True
    for sid in IDS:
        run.wait_lines(sid, SHOWN)
        gap_free(run.shown(sid))
    wait_for(lambda: held_by(holder, run.pid), REACT, "s1 and s2 held by the app")
    return run


def relaunch_from_l1(apps: Apps, holder: HolderProcess, out: Path, before: Run) -> Run:
    """The next launch reclaims both: what it shows of each starts at L1 (the journal
    had what the last run read) and goes on past what that run showed, gap-free."""
    run = apps.launch(holder, out)
    reclaimed(run)
    for sid in IDS:
        seen = len(numbered_lines(before.shown(sid)))
        run.wait_lines(sid, seen + 10)
        gap_free(run.shown(sid))
    assert not [e for e in run.events() if e["event"] == "created"], run.events()
    return run


# --- the scenarios ----------------------------------------------------------------------------


def test_a_crashed_app_reclaims_every_session_from_its_first_line(
        apps: Apps, make_holder: Holders, tmp_path: Path) -> None:
    holder = make_holder(keeper=True)
    one = first_run(apps, holder, tmp_path)
    one.crash()
    two = relaunch_from_l1(apps, holder, tmp_path, one)
    two.terminate()


def test_a_second_crash_right_after_the_reclaim_loses_nothing(
        apps: Apps, make_holder: Holders, tmp_path: Path) -> None:
    holder = make_holder(keeper=True)
    one = first_run(apps, holder, tmp_path)
    one.crash()
    two = apps.launch(holder, tmp_path)
    wait_for(lambda: any(e["event"] == "reclaimed" for e in two.events()), REACT,
             "the second run's reclaim")
    two.crash()  # as soon as it said so: whatever it showed since, the journal has
    three = relaunch_from_l1(apps, holder, tmp_path, one)
    for sid in IDS:
        assert len(numbered_lines(three.shown(sid))) >= len(numbered_lines(two.shown(sid)))
    three.terminate()


def test_the_holders_crash_under_the_app_is_taken_back_by_the_app(
        apps: Apps, make_holder: Holders, tmp_path: Path) -> None:
    holder = make_holder(keeper=True)
    one = first_run(apps, holder, tmp_path)
    fds = one.fds()
    kill_serving_holder(holder)
    one.wait_event("lapsed")
    one.wait_event("protected")  # with no call from here: the app saw it and resumed
    wait_for(lambda: held_by(holder, one.pid), REACT, "s1 and s2 held by the app again")
    for sid in IDS:
        seen = len(numbered_lines(one.shown(sid)))
        one.wait_lines(sid, seen + 10)
        gap_free(one.shown(sid))
    # A lapse and a resume cost nothing: one duplicate a session, the custody socket, the
    # masters, as before.
    wait_for(lambda: one.fds() == fds, REACT, f"the app's fds back to {fds} ({one.fds()})")
    one.crash()
    relaunch_from_l1(apps, holder, tmp_path, one).terminate()


def test_after_a_total_loss_the_app_deposits_again(
        apps: Apps, socket_dir: Path, tmp_path: Path) -> None:
    """Keeper and holder SIGKILLed: every fd they stored is gone; a new holder on the
    same socket gets the sessions deposited again from the app's duplicates."""
    directory = socket_dir / "loss"
    first = start_holder(directory, keeper=True)
    second: HolderProcess | None = None
    try:
        one = first_run(apps, first, tmp_path)
        fds = one.fds()
        record = paths.read_pidfile(first.socket)
        assert record is not None
        os.kill(first.pid, signal.SIGKILL)  # the keeper
        os.kill(record.pid, signal.SIGKILL)  # and its holder
        first.proc.wait()
        one.wait_event("lapsed")
        second = start_holder(directory, keeper=True)
        one.wait_event("protected")
        wait_for(lambda: held_by(second, one.pid), REACT, "s1 and s2 held on the new holder")
        for sid in IDS:
            seen = len(numbered_lines(one.shown(sid)))
            one.wait_lines(sid, seen + 10)
            gap_free(one.shown(sid))
        wait_for(lambda: one.fds() == fds, REACT, f"the app's fds back to {fds} ({one.fds()})")
        shown_before = {sid: numbered_lines(one.shown(sid)) for sid in IDS}
        one.crash()
        two = apps.launch(second, tmp_path)
        report = reclaimed(two)
        assert report["restarts"] is None or report["adopted"] == 0, report
        for sid in IDS:
            two.wait_lines(sid, 10)
            # The journal the old holder had went with it: the new one's began when the
            # session was deposited again, after the app had shown some lines (SHOWN at
            # least), so the replay starts there, and runs on gap-free.
            numbers = gap_free(two.shown(sid), first=None)
            assert 1 < numbers[0] <= shown_before[sid][-1] + 1, (numbers[:3],
                                                                 shown_before[sid][-3:])
        two.terminate()
    finally:
        apps.end_all()
        if second is not None:
            second.release_everything()
            second.stop()
        first.stop()


def test_a_ring_that_overflowed_replays_from_a_clean_start(
        apps: Apps, make_holder: Holders, tmp_path: Path) -> None:
    """The session printed more than the ring holds before the crash: the replay lost its
    oldest lines, is cut to a line's start, and runs gap-free from there."""
    holder = make_holder("--ring-bytes", str(RING_BYTES), keeper=True)
    env = {"TERM_APP_CMD": BURST}
    one = apps.launch(holder, tmp_path, new=["s1"], env=env)
    one.wait_event("created")
    one.wait_lines("s1", 6100)
    assert len(one.shown("s1")) > 2 * RING_BYTES
    one.crash()
    two = apps.launch(holder, tmp_path, new=["s1"], env=env)
    reclaimed(two, ["s1"])
    numbers = two.wait_lines("s1", 100)
    # numbered_lines would have failed on a first line cut in the middle: a clean start.
    assert numbers[0] > 1, "the whole output fitted the ring: nothing to trim"
    gap_free(two.shown("s1"), first=None)
    two.terminate()


def test_a_second_instance_takes_nothing_from_the_first(
        apps: Apps, make_holder: Holders, tmp_path: Path) -> None:
    """A second instance launched while the first holds the sessions takes nothing: its
    report says custody_held for each (after the grace), and the first reads on."""
    holder = make_holder(keeper=True)
    a = first_run(apps, holder, tmp_path / "a")
    b = apps.launch(holder, tmp_path / "b", new=[])
    event = b.wait_event("reclaimed")
    refused = {sid: "custody_held" for sid in IDS}
    assert event["retrieved"] == [] and event["failed"] == refused, event
    for sid in IDS:
        seen = len(numbered_lines(a.shown(sid)))
        a.wait_lines(sid, seen + 10)
        gap_free(a.shown(sid))
    assert held_by(holder, a.pid)
    assert not [e for e in a.events() if e["event"] == "lapsed"], a.events()
    b.terminate()
    a.terminate()
