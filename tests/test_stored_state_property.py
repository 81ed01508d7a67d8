"""Whatever is written into a holder's state files, the next holder serves (docs/design.md §11,
Adoption), as a property over a real keeper with ten stored sessions.

Each example: ten sessions are handed off (a shell each that printed one line, drained);
some state files get arbitrary bytes (header, record slots or ring), some an arbitrary
record with a correct CRC (any field, any value, any type), some a hot counter set to
anything, the rest are left intact; the serving holder is SIGKILLed. Then, always:
- the keeper started exactly one holder for the kill (no crash loop), and it answers
  `list` for every owner;
- every terminal is still a session, every shell alive (no master was closed), but where
  a forged record says the session ended (`handed_off`, `released`, `expired`: that is
  what a holder acts on, as it must for a removal a kill kept from the store);
- every intact session is there as it was: not marked as adopted without its record, its
  line still in its replay;
- every damaged one whose record could not be believed says so (its label, and a replay
  marked lost from the start).

The suite runs a short version; `ESCROW_PROPERTY_EXAMPLES=2000` runs the long one (about a
second an example).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from statefiles import forge, record_of, scribble, set_total, state_files
from test_untrusted_state import live

from conftest import HolderProcess, PtyChild, spawn_in_pty, wait_for
from escrow_client import EscrowClient, EscrowError, protocol
from escrowd.statefile import BIG_SLOT, PAGE
from escrowd.takeup import LOST_LABEL

SESSIONS = 10
EXAMPLES = int(os.environ.get("ESCROW_PROPERTY_EXAMPLES", "6"))

_ANY_INT = st.one_of(st.integers(-(1 << 63), (1 << 64) - 1), st.integers(-3, 70000),
                     st.sampled_from([0, 1, 1 << 31, 1 << 40, 1 << 61, 1 << 62, 4194304]))
_ANY = st.one_of(_ANY_INT, st.none(), st.booleans(), st.text(max_size=40),
                 st.floats(allow_nan=True), st.lists(_ANY_INT, max_size=4),
                 st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3))
_FIELDS = ["token", "owner", "id", "label", "child_pid", "child_start_time", "cols", "rows",
           "meta", "state", "deposited_at", "state_since", "custodian_pid",
           "custodian_start_time", "handoff_id", "handoff_peer_pid", "saved_flags",
           "capacity", "origin", "total_at_layout", "length_at_layout", "saturated",
           "consumed", "dropped_base", "journal_from", "journal_capacity", "journal_copying",
           "journal_ranges", "gap_totals", "record_lost", "instance", "clean"]
_STATES = st.sampled_from(["held", "draining", "handing_off", "exited", "handed_off",
                           "released", "expired", "bogus", ""])
_FIELD_VALUE = {"state": st.one_of(_STATES, _ANY),
                "meta": st.one_of(_ANY, st.just({f"k{i}": "v" * 1000 for i in range(32)}))}

DAMAGE = st.one_of(
    st.just(("intact",)),
    st.tuples(st.just("bytes"),
              st.one_of(st.integers(0, PAGE - 1), st.integers(PAGE, PAGE + 2 * BIG_SLOT),
                        st.integers(0, 1 << 20)),
              st.binary(min_size=1, max_size=300)),
    st.tuples(st.just("record"), st.lists(st.sampled_from(_FIELDS), min_size=1, max_size=5,
                                          unique=True).flatmap(
        lambda names: st.fixed_dictionaries(
            {n: _FIELD_VALUE.get(n, _ANY) for n in names}))),
    st.tuples(st.just("total"), _ANY_INT.filter(lambda n: 0 <= n < 1 << 64)),
)


class Starts:
    """How many holders the keeper has started: counted from its log as it grows (a long
    run's log is large; reading it whole at each look would make each example slower)."""

    def __init__(self, holder: HolderProcess) -> None:
        self.path, self.offset, self.count, self.rest = holder.log_path, 0, 0, b""

    def __call__(self) -> int:
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            new = f.read()
        self.offset += len(new)
        *lines, self.rest = (self.rest + new).split(b"\n")
        self.count += sum(b" event=keeper_started_holder " in line for line in lines)
        return self.count


def _kill_and_wait(holder: HolderProcess, starts: Starts) -> None:
    """SIGKILL the serving holder; return once the next one answers. Fails at once if the
    keeper starts more than one holder for the kill (a crash loop)."""
    admin = holder.client("escrowctl", timeout=2.0)
    before = admin.status()
    started = starts()
    os.kill(before.pid, signal.SIGKILL)

    def next_one() -> bool:
        assert starts() <= started + 1, "the keeper restarted the holder more than once"
        try:
            return admin.status().instance != before.instance
        except EscrowError:
            return False

    wait_for(next_one, 20.0, "the next holder to serve")


def _damage(path: str, how: tuple[object, ...]) -> bool:
    """Apply one damage; False if it could not be written at all (left intact)."""
    kind = how[0]
    if kind == "bytes":
        offset, data = how[1], how[2]
        assert isinstance(offset, int) and isinstance(data, bytes)
        scribble(path, offset, data)
    elif kind == "record":
        fields = how[1]
        assert isinstance(fields, dict)
        try:
            forge(path, **fields)
        except (ValueError, TypeError, OverflowError, AssertionError):
            return False  # not encodable, or too big for any slot: nothing was written
    elif kind == "total":
        value = how[1]
        assert isinstance(value, int)
        set_total(path, value)
    return kind != "intact"


def test_whatever_is_written_into_state_files_the_next_holder_serves(
    make_holder: Callable[..., HolderProcess],
) -> None:
    holder = make_holder("--unclaimed-ttl", "0", keeper=True)
    starts = Starts(holder)
    kids: list[PtyChild] = []
    runs = {"examples": 0, "damaged": 0, "lost": 0, "ended": 0}

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.lists(DAMAGE, min_size=SESSIONS, max_size=SESSIONS))
    def example(damages: list[tuple[object, ...]]) -> None:
        _clear(holder, kids)
        # An owner of its own: a session an earlier example left (one a forged record has
        # waiting for an ack from a live pid cannot be released) is never in the way.
        owner = f"com.example.prop.{runs['examples']}.{starts()}"
        client = holder.client(owner)
        for n in range(SESSIONS):
            kid = spawn_in_pty(["sh", "-c", f"printf 'line of s{n}\\n'; exec sleep 600"])
            kids.append(kid)
            client.hand_off(f"s{n}", kid.master, child_pid=kid.pid)
            os.close(kid.master)
            kid.master = -1
        wait_for(lambda: all(s.buffered_bytes for s in live(client.list())), 10.0,
                 "every line drained")
        paths = {}
        for path in state_files(holder.serving_pid()).values():
            record = record_of(path)
            if record.owner == owner:
                paths[record.id] = path
        damaged = {f"s{n}" for n, how in enumerate(damages) if _damage(paths[f"s{n}"], how)}
        may_end = {f"s{n}" for n, how in enumerate(damages) if how[0] == "record"
                   and isinstance(how[1], dict) and str(how[1].get("state")) in ENDED}
        started = starts()
        _kill_and_wait(holder, starts)
        listed = live(holder.client("escrowctl").list(all_owners=True))
        assert starts() == started + 1
        for n, kid in enumerate(kids):
            if f"s{n}" not in may_end:
                assert kid.proc.poll() is None, f"s{n}'s shell lost its terminal ({damages[n]})"
        by_pid = {s.child_pid: s for s in listed if s.label != LOST_LABEL}
        for n, kid in enumerate(kids):
            if f"s{n}" in damaged:
                continue
            info = by_pid.get(kid.pid)
            assert info is not None, f"intact s{n} is not there as it was: {listed}"
            assert info.buffered_bytes == len(f"line of s{n}\r\n"), info
        for info in listed:
            if info.label == LOST_LABEL:
                assert info.replay_gaps[:1] == [0], info
        runs["examples"] += 1
        runs["damaged"] += len(damaged)
        runs["lost"] += sum(s.label == LOST_LABEL and s.owner in (owner, "escrowd")
                            for s in listed)
        runs["ended"] += sum(kid.proc.poll() is not None for kid in kids)

    try:
        example()
    finally:
        _clear(holder, kids)
    print(f"\n[property] {runs['examples']} examples, {runs['damaged']} state files damaged, "
          f"{runs['lost']} sessions adopted without their record, {runs['ended']} ended by a "
          f"forged record saying so; keeper started {starts()} holders for as many kills + 1")
    assert runs["examples"] >= 1


ENDED = set(protocol.TOMBSTONE_STATES)


def _clear(holder: HolderProcess, kids: list[PtyChild]) -> None:
    """Release every session that can be (the holder's copies are the last ones: the shells
    end), and end every shell."""
    for info in live(holder.client("escrowctl").list(all_owners=True)):
        try:
            EscrowClient(info.owner, socket_path=holder.socket).release(info.id)
        except EscrowError:
            pass  # busy: handing off to a process that lives (a forged record says so)
    for kid in kids:
        if kid.proc.poll() is None:
            kid.proc.send_signal(signal.SIGKILL)
        kid.proc.wait()
    kids.clear()


