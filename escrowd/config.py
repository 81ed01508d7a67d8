"""The holder's settings: budgets, deadlines and limits, each with a sane default."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from escrow_client import protocol

MiB = 1 << 20


@dataclass(frozen=True)
class Config:
    socket_path: str
    # The handoff (docs/design.md §4). A client's deadline must exceed budget + send deadline.
    drain_stop_budget: float = 3.0
    send_deadline: float = 1.0
    ack_deadline: float = 10.0
    # Limits.
    max_sessions: int = 2048
    ring_bytes: int = 1 * MiB
    total_ring_bytes: int = 512 * MiB
    max_connections: int = 256
    # Fair shares: no one owner (app) takes every session slot, the whole ring budget, or
    # every connection, so another app's sessions are still escrowed with their replay.
    max_sessions_per_owner: int = 1024
    owner_ring_bytes: int = 256 * MiB
    max_connections_per_owner: int = 128
    max_request_bytes: int = protocol.MAX_REQUEST_BYTES
    idle_timeout: float = 60.0  # a connection that is not a custodian
    max_tombstones: int = 10_000
    unclaimed_ttl: float = 86_400.0  # 0 disables
    idle_exit: float = 0.0  # 0 disables
    # The keeper: how long a holder it started may take to say READY (adopting many sessions
    # on a slow machine takes seconds) before it is killed as frozen.
    ready_deadline: float = 30.0

    def limits(self) -> dict[str, int]:
        """The integer limits, as reported in `welcome` and `holder_status`."""
        return {k: v for k, v in asdict(self).items() if isinstance(v, int) and k != "socket_path"}
