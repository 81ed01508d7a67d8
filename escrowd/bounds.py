"""What a record read back from storage must satisfy to be believed (docs/design.md §11, Adoption).

A state file outlives the holder that wrote it, in a store that others can reach: another
process of the user can write it through /proc, a bug can write it wrong, and a CRC-32
proves only that a slot was written whole, not by whom or how well. So every field a holder
acts on is checked against its bounds before it is believed: pids against `pid_max`, states
against the enumeration, sizes and offsets against the file, counters against the ring,
names and metadata against the protocol's own limits (which also keep a re-written record
within its slot). A record that fails is not believed at all; what can still be proven of
its session is the adoption's business (escrowd.adoption).
"""

from __future__ import annotations

import math
import re
import time

import msgspec

from escrow_client import platform, protocol

from .modes import Modes, Scanner
from .statefile import BIG_SLOT, HolderRecord, Record

LIVE_STATES = ("held", "draining", "handing_off", "exited")
# No terminal prints 4 EiB: a counter at or past this is a record gone wrong.
MAX_TOTAL = 1 << 62
_TOKEN = re.compile(r"\A[0-9a-f]{32}\Z")
_SHORT = 128  # a handoff id, an instance: uuid hex, with room
_SPOTS = 64  # gaps and journal ranges a record keeps at most (escrowd.session)
_HEADROOM = 4096  # what a record may grow by before it is written again (a few more spots)


def record_doubt(record: Record, file_size: int, total: int) -> str | None:
    """Why `record` cannot be believed for a state file with a data area of `file_size`
    bytes whose hot counter says `total`, or None if every field is within its bounds."""
    if not _TOKEN.fullmatch(record.token):
        return "its token is not one the holder makes"
    try:  # the names, label, size and meta, as a deposit would have to give them
        msgspec.convert({"id": record.id, "label": record.label, "cols": record.cols,
                         "rows": record.rows, "meta": record.meta}, protocol.Deposit)
        msgspec.convert({"version": 1, "owner": record.owner}, protocol.Hello)
    except msgspec.ValidationError as exc:
        return f"a field out of bounds: {exc}"
    if record.state not in LIVE_STATES and record.state not in protocol.TOMBSTONE_STATES:
        return f"its state {record.state!r} is not one of the states"
    top = pid_max()
    for name in ("custodian_pid", "handoff_peer_pid"):  # (child_pid: see `believed_child`)
        pid = getattr(record, name)
        if pid is not None and not 1 <= pid <= top:
            return f"{name} {pid} is not a pid (1 to {top})"
    for name in ("child_start_time", "custodian_start_time", "deposited_at", "state_since"):
        value = getattr(record, name)
        if value is not None and not (math.isfinite(value) and value >= 0):
            return f"{name} {value!r} is not a time"
    for name in ("handoff_id", "instance"):
        value = getattr(record, name)
        if value is not None and len(value) > _SHORT:
            return f"its {name} is too long"
    if record.saved_flags is not None and not 0 <= record.saved_flags < 1 << 31:
        return "its saved file status flags are out of bounds"
    return _layout_doubt(record, file_size, total) or _size_doubt(record)


_pid_max: tuple[float, int] = (-1.0, 0)  # (when it was read, what it was)


def pid_max() -> int:
    """The system's pid_max, read at most once a second: an adoption checks thousands of
    records against it, and each read of /proc was a syscall or three."""
    global _pid_max
    now = time.monotonic()
    if now - _pid_max[0] >= 1.0:
        _pid_max = (now, platform.pid_max())
    return _pid_max[1]


def believed_child(pid: int | None) -> int | None:
    """A record's `child_pid`, or None if it cannot be a pid here: its liveness is then
    unknown, which is all a deposit's pid ever told (a deposit may name any pid up to
    2^31 - 1, and `pid_max` may be lowered since)."""
    return pid if pid is not None and 1 <= pid <= pid_max() else None


def _layout_doubt(record: Record, file_size: int, total: int) -> str | None:
    cap = record.capacity
    if not 0 <= cap <= file_size:
        return f"a ring capacity of {cap} in a file of {file_size}"
    if not (0 <= record.origin < max(cap, 1) and 0 <= record.length_at_layout <= cap):
        return "the ring's layout does not fit its capacity"
    if not 0 <= record.total_at_layout <= total < MAX_TOTAL:
        return f"the ring's counter ({total}) is behind its layout or out of bounds"
    if cap and record.length_at_layout + total - record.total_at_layout > cap and (
            not record.saturated):
        # A ring holds more than its capacity only by overwriting, which it says first.
        return f"the ring's counter ({total}) runs past what its layout could hold"
    if not (0 <= record.consumed <= total and 0 <= record.dropped_base <= total):
        return "the ring's delivery counters are out of bounds"
    if record.journal_from is not None and not 0 <= record.journal_from <= total:
        return "its journal starts past the ring's counter"
    if not 0 <= record.journal_capacity < 1 << 40:
        return "its journal's capacity is out of bounds"
    if len(record.gap_totals) > _SPOTS or len(record.journal_ranges) > _SPOTS:
        return "too many gaps or journal ranges"
    if any(not 0 <= g <= total for g in record.gap_totals):
        return "a gap past the ring's counter"
    if any(not 0 <= a <= b <= total for a, b in record.journal_ranges):
        return "a journal range out of bounds"
    if not 0 <= record.modes_at <= total:
        return "its terminal modes are recorded past the ring's counter"
    if Modes.from_stored(record.modes) is None or not Scanner.valid_pending(
            record.modes_pending):
        return "its terminal modes are not a set the holder records"
    return None


def _size_doubt(record: Record) -> str | None:
    # Checked fields keep a record far below a big slot; this holds whatever comes next.
    size = len(msgspec.msgpack.encode(record))
    if size + _HEADROOM > BIG_SLOT:
        return f"a record of {size} bytes leaves no room to be written again"
    return None


def holder_record_doubt(record: HolderRecord) -> str | None:
    """Why the holder's own record cannot be believed, or None."""
    for name in ("restarts", "unclean_restarts"):
        value = getattr(record, name)
        if value is not None and not 0 <= value < 1 << 53:
            return f"{name} {value} is out of bounds"
    if not (math.isfinite(record.started_at) and record.started_at >= 0):
        return "its start time is not a time"
    if len(record.instance) > _SHORT:
        return "its instance is too long"
    return None
