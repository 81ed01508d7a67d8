"""The protocol's parts for programs the holder starts (`start`, `wait`: PROTOCOL.md
sections 12.9, 12.10): the bounds on what a `start` may ask, a terminal's modes, and how a
program ended. Plain structs with no `type` tag, used inside escrow_client.protocol's
messages (which re-exports them) and in the holder's state files.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

# Bounds on what a `start` may ask the holder to run (its request fits MAX_REQUEST_BYTES too).
MAX_ARGS = 4096
MAX_ENV = 4096
Arg = Annotated[str, msgspec.Meta(max_length=65536)]
EnvName = Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]


class Modes(msgspec.Struct, kw_only=True):
    """A terminal's termios attributes, as tcgetattr gives them on this machine (the
    holder and its clients share it): a started program's PTY gets them."""

    iflag: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
    oflag: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
    cflag: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
    lflag: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
    ispeed: Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]
    ospeed: Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]
    cc: Annotated[list[Annotated[int, msgspec.Meta(ge=0, le=255)]], msgspec.Meta(max_length=64)]


class ExitStatus(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How a program the holder started ended: exactly one of its exit `code` or the
    `signal` that killed it."""

    code: Annotated[int, msgspec.Meta(ge=0, le=255)] | None = None
    signal: Annotated[int, msgspec.Meta(ge=1, le=255)] | None = None

    def __post_init__(self) -> None:
        if (self.code is None) == (self.signal is None):
            raise ValueError("an exit status has exactly one of code and signal")

    def shell_status(self) -> int:
        """As a shell reports it: the code, or 128+N for signal N."""
        return self.code if self.code is not None else 128 + (self.signal or 0)


# A program's ending: how it ended, "unknown" when nobody can know (it was not the
# holder's child when it ended, and no status was kept), None while it runs (or for a
# session whose program the holder did not start).
ProgramEnd = ExitStatus | Literal["unknown"] | None
