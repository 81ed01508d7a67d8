"""`escrowctl status`: is a holder running on the socket? From positive proof only
(`liveness.holder_verdict`, docs/design.md §7), and read-only; the verdict is the exit status.

This module only writes the verdict out: as a summary of the holder that answered, as the
evidence when none did, or as JSON.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import msgspec

from .. import advice, liveness, paths
from ..liveness import STATUS_TIMEOUT, Verdict, holder_verdict
from ..protocol import HolderStatus
from ..serving import serving_holder
from . import describe
from .arguments import add_sub_timeout
from .text import duration, print_json, size

# docs/design.md §7: 0 only for running; the others follow the LSB status codes, plus 150 (from
# the LSB's application-specific range) for a holder that accepted but did not answer.
STATUS_EXIT_CODES: dict[str, int] = {
    "running": 0,
    "dead": 1,
    "not_running": 3,
    "indeterminate": 4,
    "unresponsive": 150,
}

_VERDICT_ROWS = (  # docs/design.md §7, in the order the rows are tried
    ("running", "the socket answered `status` within the timeout"),
    ("unresponsive", "a process holds the lock; the socket accepted a connection\n"
     "but did not answer within the timeout (wedged, or stopped)"),
    ("indeterminate", "a process holds the lock, but the socket is missing or\n"
     "refuses (a holder starting or stopping)"),
    ("dead", "nobody holds the lock, the socket does not answer, and a\n"
     "socket file or pidfile is left over (the next escrowd\non this path removes them)"),
    ("not_running", "nobody holds the lock, and no socket file or pidfile exists"),
    ("indeterminate", "anything else (e.g. the lock file cannot be read)"),
)
_EPILOG = (
    "verdicts (the first that matches wins) and exit status:\n"
    + "".join(f"  {state:<13}  {STATUS_EXIT_CODES[state]:>3}  "
              + what.replace("\n", "\n" + " " * 22) + "\n"
              for state, what in _VERDICT_ROWS)
    + "A missing, empty or half-written pidfile never makes a live holder look dead.\n"
    "Codes 1, 3 and 4 are the LSB status codes; 150 (from the LSB's range for\n"
    f"applications) is unresponsive. Default timeout: {STATUS_TIMEOUT:g}s.\n"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    describe(
        p,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Say whether a holder runs on the socket, from positive proof only, and "
        "summarise it.\nRead-only: it deletes nothing, creates nothing, and takes no lock "
        "(the lock is read\nwith F_GETLK), so it never stops a holder from starting.",
        epilog=_EPILOG,
    )
    p.add_argument("--json", action="store_true",
                   help='print {"state", "pid", "socket", "holder", "evidence", ...} as JSON')
    add_sub_timeout(p, "how long the holder has to answer before it counts as unresponsive")
    p.set_defaults(func=run, default_timeout=STATUS_TIMEOUT)


def run(args: argparse.Namespace) -> int:
    socket_path = paths.resolve_socket_path(args.socket)
    verdict = holder_verdict(socket_path, args.timeout, list_sessions=True)
    buffered = (sum(s.buffered_bytes for s in verdict.sessions)
                if verdict.sessions is not None else None)
    if args.json:
        print_json({
            "state": verdict.state,
            "pid": verdict.pid,
            "socket": verdict.socket,
            "holder": _holder_dict(verdict.holder) if verdict.holder is not None else None,
            "keeper": _keeper(verdict),
            "evidence": verdict.evidence,
            "reason": verdict.reason,
            "buffered_bytes": buffered,
        })
    else:
        print(_status_text(verdict, buffered))
    return STATUS_EXIT_CODES.get(verdict.state, STATUS_EXIT_CODES["indeterminate"])


def _keeper(verdict: Verdict) -> dict[str, Any] | None:
    """The keeper, when the holder answered that it runs under one: the process that holds
    the lock (and the sessions' fds while no holder runs)."""
    pid = verdict.holder.keeper_pid if verdict.holder is not None else None
    return {"pid": pid} if pid is not None else None


def _holder_dict(status: HolderStatus) -> dict[str, Any]:
    fields: dict[str, Any] = msgspec.to_builtins(status)
    fields.pop("type", None)  # the message tag, not a field of the status
    return fields


def _status_text(verdict: Verdict, buffered: int | None) -> str:
    status = verdict.holder
    if status is None:
        text = _no_answer_text(verdict)
        if verdict.state in ("not_running", "dead"):
            text += f"\n  next      {advice.start_holder(verdict.socket)}"
        return text
    by_state = ", ".join(f"{n} {state}" for state, n in sorted(status.sessions_by_state.items()))
    lines = [
        f"escrowd: {verdict.state} (pid {status.pid}, version {status.version})",
        f"  socket    {status.socket}",
        f"  uptime    {duration(time.time() - status.started_at)}",
        f"  sessions  {by_state or 'none'}",
        f"  buffered  {size(buffered) if buffered is not None else '?'} of replay",
        f"  open fds  {status.open_fds if status.open_fds is not None else '?'}",
        f"  rss       {size(status.rss_bytes) if status.rss_bytes is not None else '?'}",
    ]
    return "\n".join(lines)


_ANSWER_TEXT = {
    liveness.ACCEPTED_NO_ANSWER: "accepted a connection, no answer",
    liveness.CLOSED: "accepted a connection, then closed it unanswered",
    liveness.ERROR_ANSWER: "answered with an error",
    liveness.REFUSED: "refuses connections",
    liveness.MISSING: "missing",
    liveness.ERROR: "cannot connect",
    liveness.UNTRUSTED: "not yours: nothing was sent to it",
}


def _no_answer_text(verdict: Verdict) -> str:
    ev = verdict.evidence
    pid = f" (pid {verdict.pid})" if verdict.pid is not None else ""
    if "socket_answer" not in ev:  # refused on trust before anything was looked at
        return f"escrowd: {verdict.state} on {verdict.socket}\n  {verdict.reason}"
    answer = _ANSWER_TEXT.get(ev["socket_answer"], ev["socket_answer"])
    if ev.get("socket_file") == "other":
        answer = "not a socket: nothing can listen there"  # what "refused" meant here
    elif ev.get("socket_error"):
        answer += f": {ev['socket_error']}"
    lock = {"held": f"held by {_pid_text(ev['lock_holder_pid'])}", "free": "free",
            "missing": "no lock file (free)"}.get(ev["lock"], ev["lock"])
    if ev.get("lock_error"):
        lock += f": {ev['lock_error']}"
    record = ev["pidfile"]
    if record["pid"] is not None:
        alive = {True: "alive", False: "gone", None: "cannot tell"}[record["alive"]]
        pidfile = f"pid {record['pid']} ({alive})"
    else:
        pidfile = "unreadable (empty or half-written)" if record["exists"] else "none"
    lines = [
        f"escrowd: {verdict.state.replace('_', ' ')} on {verdict.socket}{pid}",
        *_stuck(verdict),
        f"  {verdict.reason}",
        f"  socket    {answer}",
        f"  lock      {lock}",
        f"  pidfile   {pidfile}",
    ]
    if ev["leftovers"]:
        lines.append(f"  leftover  {', '.join(ev['leftovers'])}")
    return "\n".join(lines)


def _stuck(verdict: Verdict) -> list[str]:
    """The holder that does not answer, named when its listener is its keeper: the
    keeper's pid (the lock's, the peer's) alone would point at a process that is fine."""
    keeper = verdict.evidence.get("socket_peer_pid")
    if verdict.state != "unresponsive" or keeper is None:
        return []
    holder = serving_holder(verdict.socket, keeper)
    if holder is None or holder == keeper:
        return []
    return [f"  holder pid {holder} is not answering (its keeper pid {keeper} is alive and "
            "holds the socket)"]


def _pid_text(pid: int | None) -> str:
    return f"pid {pid}" if pid is not None else "a process in another pid namespace"
