"""The default deadlines of a call to the holder, in a module of their own: `escrowctl`'s
`--help` names them, and building its parser must not import the modules that use them.

`DEFAULT_TIMEOUT` is `EscrowClient`'s (docs/design.md §4: longer than the holder's
drain-stop budget plus its send deadline); `STATUS_TIMEOUT` is `escrowctl status`'s and
`stop`'s, short because a monitor runs it all day and a holder that answers at all answers
`status` in milliseconds. `reclaim_all`'s are here because `EscrowClient`'s signature
names them, and `escrowctl list` makes an `EscrowClient` without importing `reclaim`.
"""

from __future__ import annotations

DEFAULT_TIMEOUT = 5.0
STATUS_TIMEOUT = 2.0

DEFAULT_RECLAIM_DEADLINE = 8.0
# How long reclaim_all retries custody_held before it believes another live instance holds
# the session (an old instance that is exiting lets go within this).
DEFAULT_CUSTODY_GRACE = 1.0
