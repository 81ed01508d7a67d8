"""A wait on the holder that lasts, told to a person: what it waits for, once.

A wedged holder (stopped, or stuck) makes each call wait its whole deadline in silence,
and five seconds of nothing reads as a hang. So a caller that speaks to a person
(`escrowctl`) registers a `Teller`; then every wait on the holder (connecting and greeting
it, a call, `escrowctl status`'s probe) that has not ended after `AFTER` seconds is told to
it: the socket, the pid of the listener (None where it is not known yet) and the seconds
the wait may take in all. At most once per process: one wait is news, the next ones would
be noise.

With no `Teller` (any library caller), nothing is started and nothing is said. A timer
thread tells it, never a signal: SIGALRM would clobber an alarm of the process the client
runs in. The teller is called under a lock that the wait's end takes too: once a wait has
ended (its answer came, or its error), nothing is told for it. `quiet()` holds every
telling off, for as long as something else owns the screen (an attached terminal's
program: a line of ours would land in the middle of its display).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

Teller = Callable[[str, "int | None", float], None]

AFTER = 1.0  # seconds: shorter than any deadline worth telling, longer than any answer

_teller: Teller | None = None
_lock = threading.Lock()
_told = False
_quiet = 0


def tell_with(teller: Teller | None) -> None:
    """Tell waits to `teller` from now on (None: to nobody)."""
    global _teller
    _teller = teller


@contextmanager
def quiet() -> Iterator[None]:
    """No telling while inside (nested: until the outermost ends)."""
    global _quiet
    with _lock:
        _quiet += 1
    try:
        yield
    finally:
        with _lock:
            _quiet -= 1


@contextmanager
def waiting(socket_path: str, listener: Callable[[], int | None],
            seconds: float) -> Iterator[None]:
    """A wait of up to `seconds` on the holder on `socket_path`; `listener()` names the
    listener's pid when the wait is told (it may be known only by then)."""
    teller = _teller
    if teller is None or _told:
        yield
        return
    ended = threading.Event()

    def tell() -> None:
        global _told
        with _lock:
            if ended.is_set() or _quiet or _told:
                return
            _told = True
            teller(socket_path, listener(), seconds)

    timer = threading.Timer(AFTER, tell)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        with _lock:
            ended.set()
        timer.cancel()
