"""The arguments more than one verb takes, their types for argparse, and the client a verb
makes from them.

Every check here happens while the command line is parsed, so a bad session name or
timeout is argparse's usage error (exit status 2), before anything is sent to the holder.
"""

from __future__ import annotations

import argparse
import os
import re

from .. import liveness, protocol
from ..deadlines import STATUS_TIMEOUT

# `attach` (the terminal, its keys, its signals) is imported by the verbs that attach, and
# `client` by those that call the holder: `status` takes its options from here too.
TYPE_CHECKING = False  # mypy takes any TYPE_CHECKING as true
if TYPE_CHECKING:
    from ..client import EscrowClient

# The owner escrowctl names itself with when it only looks (status, list of every owner),
# and the owner of what `run` starts unless told otherwise.
ADMIN_OWNER = liveness.ADMIN_OWNER

_NAME_RE = re.compile(protocol.NAME_PATTERN)


def client(args: argparse.Namespace, owner: str, autostart: bool = False) -> EscrowClient:
    """A client of the holder on `--socket`, speaking for `owner`. With `autostart`, a
    holder is started if none answers, and runs until stopped (no idle exit: a person who
    ran a session expects the holder there when they come back)."""
    from ..client import EscrowClient

    return EscrowClient(owner, socket_path=args.socket, timeout=args.timeout,
                        client_name=f"escrowctl pid={os.getpid()}", autostart=autostart,
                        autostart_idle_exit=0)


def admin(args: argparse.Namespace) -> EscrowClient:
    """A client that only looks (it owns no session)."""
    return client(args, ADMIN_OWNER)


def positive(text: str) -> float:
    """A number of seconds, for `--timeout` and `--wait`."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < 86400 * 365:
        raise argparse.ArgumentTypeError("must be a positive number of seconds")
    return value


def name(text: str) -> str:
    """An owner or a session id, as the protocol allows them."""
    if not _NAME_RE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r} must be 1-128 of A-Z a-z 0-9 . _ : @ -")
    return text


def session_ref(text: str) -> tuple[str, str]:
    """`OWNER/ID` for argparse: split on the first '/' and check both names."""
    owner, slash, sid = text.partition("/")
    if not slash:
        raise argparse.ArgumentTypeError(f"{text!r} is not OWNER/ID (e.g. com.example.term/tab-1)")
    for what, part in (("owner", owner), ("session id", sid)):
        if not _NAME_RE.fullmatch(part):
            raise argparse.ArgumentTypeError(
                f"{what} {part!r} must be 1-128 of A-Z a-z 0-9 . _ : @ -")
    return owner, sid


def detach_key(text: str) -> int | None:
    from .. import attach

    try:
        return attach.parse_key(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_session_ref(p: argparse.ArgumentParser) -> None:
    p.add_argument("session", metavar="OWNER/ID", type=session_ref,
                   help="the session, as `escrowctl list` shows it")


def add_detach_key(p: argparse.ArgumentParser) -> None:
    from .. import attach

    p.add_argument("--detach-key", type=detach_key, metavar="KEY",
                   default=attach.parse_key(attach.DEFAULT_DETACH_KEY),
                   help=f"the key that detaches (default {attach.DEFAULT_DETACH_KEY}, that is "
                   "Ctrl-\\); press it twice quickly to send it to the session itself; "
                   "`none`: no detach key")


def add_sub_timeout(p: argparse.ArgumentParser, what: str) -> None:
    """`--timeout` after the subcommand too (`escrowctl status --timeout 1`)."""
    p.add_argument("--timeout", dest="sub_timeout", type=positive, default=None,
                   metavar="SECONDS", help=f"{what} (default {STATUS_TIMEOUT:g})")
