"""The client's exceptions. Each carries `code`: the protocol's error code where the holder
answered one, or a client-side code (`unavailable`, `unresponsive`, `config`, `protocol`).

Causes of `EscrowError`, by class:
- answered by the holder: BadRequest, UnsupportedVersion, Forbidden, SessionUnknown,
  SessionExists, NotATerminal, CustodyHeld, Busy, DrainStopTimeout, LimitReached, HandedOff,
  Released, Expired, AckLate, CwdGone, ExecFailed, NotAProgram;
- found by the client: HolderUnavailable (nothing is listening), HolderUnresponsive (a call
  timed out, or the circuit breaker is open), EscrowConfigError (the timeout invariant, or a
  bad argument), ProtocolViolation (the holder sent something that is not the protocol).
"""

from __future__ import annotations


class EscrowError(Exception):
    """`request_sent` is False when the call failed before its request had wholly left
    (then the holder cannot have acted on it)."""

    code = "error"
    request_sent = True

    def __init__(self, message: str, session_id: str | None = None) -> None:
        super().__init__(message)
        self.session_id = session_id


class BadRequest(EscrowError):
    code = "bad_request"


class UnsupportedVersion(EscrowError):
    code = "unsupported_version"


class Forbidden(EscrowError):
    code = "forbidden"


class SessionUnknown(EscrowError):
    code = "unknown"


class SessionExists(EscrowError):
    code = "exists"


class NotATerminal(EscrowError):
    code = "not_a_terminal"


class CustodyHeld(EscrowError):
    code = "custody_held"


class Busy(EscrowError):
    code = "busy"


class DrainStopTimeout(EscrowError):
    code = "drain_stop_timeout"


class LimitReached(EscrowError):
    code = "limit"


class HandedOff(EscrowError):
    code = "handed_off"


class Released(EscrowError):
    code = "released"


class Expired(EscrowError):
    code = "expired"


class AckLate(EscrowError):
    code = "ack_late"


class CwdGone(EscrowError):
    code = "cwd_gone"


class ExecFailed(EscrowError):
    code = "exec_failed"


class NotAProgram(EscrowError):
    code = "not_a_program"


class HolderUnavailable(EscrowError):
    """`dropped` is True when a connection was made and then ended under the call (the
    holder stopped or restarted meanwhile), False when nothing was listening at all."""

    code = "unavailable"

    def __init__(
        self, message: str, session_id: str | None = None, *, dropped: bool = False
    ) -> None:
        super().__init__(message, session_id)
        self.dropped = dropped


class DepositIndeterminate(EscrowError):
    """A deposit went out and no answer came (the holder went away, or did not answer in
    time): whether the session is escrowed is not known. Custody keeps its copy of the
    master and settles it when it reaches a holder again (`protected` is False until
    then); `release` gives it up. `cause` is what the call raised."""

    code = "indeterminate"

    def __init__(self, message: str, session_id: str | None = None, *,
                 cause: EscrowError | None = None) -> None:
        super().__init__(message, session_id)
        self.cause = cause


class HolderUnresponsive(EscrowError):
    """`timed_out` is True only where a deadline really passed waiting for the holder (one
    timeout paid); False where the call failed fast (the circuit breaker was open, or there
    was no time left to try)."""

    code = "unresponsive"

    def __init__(
        self, message: str, session_id: str | None = None, *, timed_out: bool = False
    ) -> None:
        super().__init__(message, session_id)
        self.timed_out = timed_out


class EscrowConfigError(EscrowError):
    code = "config"


class ProtocolViolation(EscrowError):
    code = "protocol"


_BY_CODE: dict[str, type[EscrowError]] = {
    cls.code: cls
    for cls in (
        BadRequest, UnsupportedVersion, Forbidden, SessionUnknown, SessionExists, NotATerminal,
        CustodyHeld, Busy, DrainStopTimeout, LimitReached, HandedOff, Released, Expired, AckLate,
        CwdGone, ExecFailed, NotAProgram,
    )
}


def from_code(code: str, message: str, session_id: str | None = None) -> EscrowError:
    """The exception for an `error` answer; an unknown code still keeps its code."""
    cls = _BY_CODE.get(code)
    if cls is not None:
        return cls(message, session_id)
    exc = EscrowError(message, session_id)
    exc.code = code
    return exc
