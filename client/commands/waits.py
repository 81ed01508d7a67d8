"""What `escrowctl` says on stderr when a call waits on the holder for over a second
(`escrow_client.waiting` decides when; this, in what words): the holder named by its own
pid, and its keeper's where the listener is a keeper (`escrow_client.serving`)."""

from __future__ import annotations

import sys

from ..serving import serving_holder


def tell(socket_path: str, listener: int | None, seconds: float) -> None:
    if listener is None:
        what = f"the holder on {socket_path} to accept the connection"
    else:
        holder = serving_holder(socket_path, listener)
        who = (f"pid {listener}" if holder in (None, listener)
               else f"pid {holder}, under its keeper pid {listener}")
        what = f"the holder ({who}) on {socket_path} to answer"
    try:
        print(f"escrowctl: waiting for {what} (up to {seconds:.0f} s)...", file=sys.stderr,
              flush=True)
    except OSError:
        pass  # stderr gone: the wait goes on regardless
