"""escrow_client: hand PTY masters to escrowd and take them back (a blocking API).

Every public name is importable from here (`from escrow_client import EscrowClient`), and
each is imported from its module only when first asked for (PEP 562): `escrowctl status`
imports this package, and must not pay for custody, reclaim and the rest to get it.
"""

from __future__ import annotations

__version__ = "0.1.0"

# Three functions share their names with their modules, and importing a module binds its
# name on the package: were they lazy, the first `import escrow_client.repaint` anywhere
# would make `escrow_client.repaint` the module for everyone after. They cost about a
# millisecond, so they are imported now.
from .after_replay import after_replay
from .repaint import repaint
from .safe_replay import safe_replay

TYPE_CHECKING = False  # `typing` is not imported for it; mypy takes any TYPE_CHECKING as true
if TYPE_CHECKING:
    from .client import EscrowClient
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
    from .reclaim import ReclaimReport
    from .retrieved import Retrieved

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
    "__version__",
    "after_replay",
    "repaint",
    "safe_replay",
]

# Each public name's module; the errors are every name not listed.
_HOMES = {
    "EscrowClient": "client", "Custody": "custody", "ReclaimReport": "reclaim",
    "Retrieved": "retrieved", "HolderStatus": "protocol", "SessionInfo": "protocol",
}


def __getattr__(name: str) -> object:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{_HOMES.get(name, 'errors')}", __name__), name)
    globals()[name] = value  # asked once: later lookups find it without calling here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
