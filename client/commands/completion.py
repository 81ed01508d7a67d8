"""`escrowctl completion bash|zsh|fish`: print the shell's completion script
(`escrow_client.completion` writes it from the parser)."""

from __future__ import annotations

import argparse

from .. import completion
from . import describe


def add_arguments(p: argparse.ArgumentParser) -> None:
    describe(
        p,
        description="Print the completion script for SHELL: verbs, options, and the ids of "
        "the sessions a running holder holds. bash: source <(escrowctl completion bash), "
        "or save it in ~/.local/share/bash-completion/completions/escrowctl; zsh: save it "
        "as _escrowctl in a directory of $fpath; fish: save it as "
        "~/.config/fish/completions/escrowctl.fish.",
    )
    p.add_argument("shell", choices=completion.SHELLS, metavar="SHELL",
                   help=f"one of {', '.join(completion.SHELLS)}")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    print(completion.script(args.shell), end="")
    return 0
