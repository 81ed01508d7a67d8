"""escrow_client: hand PTY masters to escrowd and take them back (a blocking API)."""

from .after_replay import after_replay
from .client import EscrowClient, ReclaimReport, Retrieved
from .custody import Custody
from .errors import (
    AckLate,
    BadRequest,
    Busy,
    CustodyHeld,
    DepositIndeterminate,
    DrainStopTimeout,
    EscrowConfigError,
    EscrowError,
    Expired,
    Forbidden,
    HandedOff,
    HolderUnavailable,
    HolderUnresponsive,
    LimitReached,
    NotATerminal,
    ProtocolViolation,
    Released,
    SessionExists,
    SessionUnknown,
    UnsupportedVersion,
)
from .protocol import HolderStatus, SessionInfo
from .repaint import repaint
from .safe_replay import safe_replay

__version__ = "0.1.0"

__all__ = [
    "AckLate",
    "BadRequest",
    "Busy",
    "Custody",
    "CustodyHeld",
    "DepositIndeterminate",
    "DrainStopTimeout",
    "EscrowClient",
    "EscrowConfigError",
    "EscrowError",
    "Expired",
    "Forbidden",
    "HandedOff",
    "HolderStatus",
    "HolderUnavailable",
    "HolderUnresponsive",
    "LimitReached",
    "NotATerminal",
    "ProtocolViolation",
    "ReclaimReport",
    "Released",
    "Retrieved",
    "SessionExists",
    "SessionInfo",
    "SessionUnknown",
    "UnsupportedVersion",
    "after_replay",
    "repaint",
    "safe_replay",
]
