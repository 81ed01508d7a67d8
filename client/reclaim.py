"""Reclaiming: an app at launch takes back every session of its owner (docs/design.md §4, §12).

One connection, one shared deadline. First the holder's status (who answered, and whether
it restarted: an empty report from a holder that started with nothing after restarts means
the escrow was lost, not that there was none), then its list; then every live session is
retrieved, in one `retrieve_many` where the holder has it, in rounds until each is taken
back or has failed for good:

- `custody_held` is retried for the grace period (the old instance may still be exiting);
  after it, only a session whose custodian is positively dead is retried (the holder is
  about to see the hang-up): another live instance holds the others;
- `busy` is retried (another client's handoff may yet be put back);
- anything else is the session's answer, in `failed`; it stays escrowed.

No retrieve starts with less than the holder's drain-stop budget plus send deadline left
(the timeout invariant, `retrieve.check_invariant`). Whatever stops a reclaim, the fds
already retrieved are the caller's: the exception carries the report (`reclaim_report`).

Without `keep` the sessions leave escrow; with it (`Custody.reclaim_all`) they stay
escrowed, held by the custody's connection.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from . import errors, protocol
from .channel import Channel, Connect, Deadline
from .deadlines import DEFAULT_CUSTODY_GRACE, DEFAULT_RECLAIM_DEADLINE
from .liveness import process_alive
from .retrieve import RetrieveMany, check_invariant
from .retrieved import Retrieved

__all__ = ["DEFAULT_CUSTODY_GRACE", "DEFAULT_RECLAIM_DEADLINE", "ReclaimReport", "reclaim"]


@dataclass
class ReclaimReport:
    """What `reclaim_all` took back, what it could not, and who answered: an empty report
    from a holder that started with nothing (`adopted` 0) after restarts (`restarts`,
    `unclean_restarts` above 0, or None: unknown) means the escrow was lost, not that there
    was none."""

    retrieved: dict[str, Retrieved] = field(default_factory=dict)
    failed: dict[str, errors.EscrowError] = field(default_factory=dict)
    holder_instance: str = ""
    adopted: int = 0
    restarts: int | None = 0  # None: unknown (the holder lost its count)
    unclean_restarts: int | None = 0


def reclaim(
    channel: Channel, until: Deadline, deadline: float, grace: float,
    keep: bool = False, journal: bool = False, *, timeout: float, connect: Connect,
    retrieve_many: RetrieveMany,
) -> ReclaimReport:
    """`reclaim_all` on `channel` (a custody's, with `keep`). Without `keep`, a
    connection that failed is replaced for the next round; with it, it is not (custody
    is the caller's to take back), and what is left fails."""
    report = ReclaimReport()
    try:
        call = Deadline(min(timeout, until.remaining()))
        w = channel.welcome
        check_invariant(w, timeout)
        check_invariant(w, deadline, "reclaim deadline")
        status, _ = channel.call_for(protocol.Status(), protocol.HolderStatus, call)
        report.holder_instance, report.adopted = status.instance, status.adopted
        report.restarts = status.restarts
        report.unclean_restarts = status.unclean_restarts
        reply, _ = channel.call_for(protocol.List(), protocol.Sessions, call)
        live = {s.id: s for s in reply.sessions if s.state in protocol.LIVE_STATES}
        if live:
            check_invariant(w, until.remaining(), "reclaim deadline left")
        pending = list(live)
        grace_ends = Deadline(grace)
        pause = 0.02
        while pending:
            if until.remaining() <= w.drain_stop_budget + w.send_deadline:
                for sid in pending:
                    # Out of time: keep the last real answer (custody_held, busy) if
                    # the session had one.
                    report.failed.setdefault(sid, errors.HolderUnresponsive(
                        f"not enough of the reclaim deadline left to retrieve {sid}", sid))
                break
            call = Deadline(min(timeout, until.remaining()))
            got: dict[str, Retrieved] = {}
            failed: dict[str, errors.EscrowError] = {}
            try:
                if channel.sock.fileno() < 0:
                    if keep:
                        raise errors.HolderUnavailable(
                            "the custody connection closed during the reclaim")
                    channel = connect(call)
                # One request for them all, where the holder has retrieve_many.
                size = (protocol.MAX_BATCH if "retrieve_many" in w.features else 1)
                for start in range(0, len(pending), size):
                    batch = pending[start : start + size]
                    more, less = retrieve_many(channel, batch, call, keep, journal,
                                               replay_file=True)
                    got.update(more)
                    failed.update(less)
            except errors.EscrowError as exc:
                # The requests of this round that answered stand: what they took is the
                # caller's, and only the sessions still unanswered failed with `exc`.
                failed.update((sid, exc) for sid in pending
                              if sid not in got and sid not in failed)
                if not keep and isinstance(
                    exc, errors.HolderUnresponsive | errors.HolderUnavailable
                ):
                    channel.close()
            except BaseException as exc:
                report.retrieved.update(got)
                report.retrieved.update(getattr(exc, "retrieved_all", {}))
                raise
            report.retrieved.update(got)
            retry: list[str] = []
            for sid in pending:
                why = failed.get(sid)
                if why is None:
                    report.failed.pop(sid, None)
                    continue
                report.failed[sid] = why
                if isinstance(why, errors.CustodyHeld):
                    if grace_ends.remaining() > 0 or _custodian_dead(live[sid]):
                        retry.append(sid)
                elif isinstance(why, errors.Busy):
                    retry.append(sid)  # another client's handoff may yet be put back
            pending = retry
            if pending:
                time.sleep(min(pause, max(0.0, until.remaining())))
                pause = min(pause * 2, 0.25)
    except BaseException as exc:
        # Whatever stops us, the fds already retrieved are the caller's: hand them over.
        exc.reclaim_report = report  # type: ignore[attr-defined]
        raise
    finally:
        if not keep:
            channel.close()  # (a replacement made here; the first is the caller's too)
    return report


def _custodian_dead(info: protocol.SessionInfo) -> bool:
    """Positive proof only: the custodian's pid is gone, or a zombie."""
    return process_alive(info.custodian_pid, None) is False
