"""`escrowctl release OWNER/ID`: make the holder close its copy of a session's terminal."""

from __future__ import annotations

import argparse

from . import describe
from .arguments import add_session_ref, client


def add_arguments(p: argparse.ArgumentParser) -> None:
    describe(
        p,
        description="Make the holder close its copy of a session's terminal (as when the user "
        "closes the tab). If no app holds the terminal either, its programs get SIGHUP.",
    )
    add_session_ref(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    owner, sid = args.session
    client(args, owner).release(sid)
    print(f"released {owner}/{sid}: escrowd closed its copy of the terminal")
    return 0
