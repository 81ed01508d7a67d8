"""Shell completion for `escrowctl`: the scripts `escrowctl completion bash|zsh|fish` prints,
and the session ids they complete.

The scripts are written from the parser (`parser.VERBS` and each verb's arguments, read
by `command_line`), so a verb added to VERBS is completed by the next script printed,
without a word of shell written for it. Each script completes the verbs, the options of
the top and of each verb, a positional's choices, and, for a verb that takes a session
(`OWNER/ID`, `commands.arguments.add_session_ref`), the ids of the sessions a live holder
holds. After the `--` of a verb that runs a command (`run`, `install-service`) the shell's
own completion takes over: that is a command line of its own.

The ids come from `escrowctl _complete sessions WORDS...` (`print_sessions`), which
`cli.main` answers before argparse is loaded: WORDS are the command line typed so far, so
that a `--socket PATH` on it is the holder asked. It asks once, for a second at most (one
deadline for connect and list, and an alarm over the whole process), never starts a holder
itself, and says nothing and exits 0 when there is none, or anything goes wrong: a Tab
that prints an error into the line being typed is worse than one that completes nothing.
It prints only ids that are protocol names, and the scripts match them as strings: what a
listener on the socket says must never become words a shell expands.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

SHELLS = ("bash", "zsh", "fish")
SESSION_METAVAR = "OWNER/ID"
# How long a Tab waits for the holder: a person is waiting on it.
SESSIONS_TIMEOUT = 1.0


@dataclass(frozen=True)
class Option:
    names: tuple[str, ...]  # -h, --help
    value: str | None  # its metavar when it takes a value
    help: str


@dataclass(frozen=True)
class Verb:
    name: str
    help: str
    options: tuple[Option, ...]
    choices: tuple[str, ...]  # what its positional may be, when the parser says
    sessions: bool  # it takes an OWNER/ID
    command: bool  # what follows its `--` is a command line of its own (argparse.REMAINDER)


def command_line() -> tuple[tuple[Option, ...], tuple[Verb, ...]]:
    """The top options and every verb of `escrowctl`, as its parser has them."""
    from .parser import VERBS, build_parser, every_verb

    top = build_parser()
    parsers = every_verb(top)
    verbs = tuple(_verb(name, line, parsers[name]) for name, _, line in VERBS)
    return _options(top), verbs


def _verb(name: str, line: str, parser: argparse.ArgumentParser) -> Verb:
    positionals = [a for a in parser._actions if not a.option_strings]
    choices = tuple(str(c) for a in positionals for c in (a.choices or ()))
    sessions = any(a.metavar == SESSION_METAVAR for a in positionals)
    command = any(a.nargs == argparse.REMAINDER for a in positionals)
    return Verb(name, line, _options(parser), choices, sessions, command)


def _options(parser: argparse.ArgumentParser) -> tuple[Option, ...]:
    return tuple(
        Option(tuple(a.option_strings), _value(a), _short(a.help or ""))
        for a in parser._actions if a.option_strings and a.help != argparse.SUPPRESS)


def _value(action: argparse.Action) -> str | None:
    if action.nargs == 0:
        return None
    return str(action.metavar or action.dest.upper())


def _short(text: str) -> str:
    """A help text's first clause, on one line: what a menu of candidates has room for."""
    text = " ".join(text.split())
    text = re.split(r" \(|; |: |\. ", text, maxsplit=1)[0]
    return text if len(text) <= 60 else text[:57].rsplit(" ", 1)[0] + "..."


def script(shell: str) -> str:
    """The completion script for `shell` (one of SHELLS)."""
    top, verbs = command_line()
    return {"bash": _bash, "zsh": _zsh, "fish": _fish}[shell](top, verbs)


def _valued(options: Sequence[Option]) -> list[str]:
    return [n for o in options if o.value for n in o.names]


def _names(options: Sequence[Option]) -> str:
    return " ".join(n for o in options for n in o.names)


def _bash(top: Sequence[Option], verbs: Sequence[Verb]) -> str:
    cases = "".join(
        f"        {v.name}) options='{_names(v.options)}'; valued='{' '.join(_valued(v.options))}'"
        f"; words='{' '.join(v.choices)}'; sessions={int(v.sessions)}"
        f"; command={int(v.command)} ;;\n"
        for v in verbs)
    return f"""\
# bash completion for escrowctl, written by `escrowctl completion bash`.
# Load it with: source <(escrowctl completion bash)
# Candidates are matched as strings into COMPREPLY, never through `compgen -W` or an
# unquoted $(...): an id the holder sends is data, not words for the shell to expand.
_escrowctl_add() {{
    local w
    while IFS= read -r w; do
        [[ -n $w && $w == "$cur"* ]] && COMPREPLY+=("$w")
    done
}}
_escrowctl() {{
    local line=${{COMP_LINE:0:COMP_POINT}} verb='' at=0 i
    local cur=${{line##*[[:space:]]}} prev=${{COMP_WORDS[COMP_CWORD-1]}}
    # `--opt=value` is three words here (`=` breaks words): the option is before the `=`.
    [[ $prev == = ]] && prev=${{COMP_WORDS[COMP_CWORD-2]}}
    [[ ${{COMP_WORDS[COMP_CWORD]}} == = ]] && prev=${{COMP_WORDS[COMP_CWORD-1]}}
    for ((i = 1; i < COMP_CWORD; i++)); do
        case ${{COMP_WORDS[i]}} in
            {'|'.join(_valued(top)) or '--'}) [[ ${{COMP_WORDS[i+1]}} == = ]] && ((i++)); ((i++)) ;;
            -*) ;;
            *) verb=${{COMP_WORDS[i]}}; at=$i; break ;;
        esac
    done
    local options='{_names(top)}' valued='{' '.join(_valued(top))}'
    local words='{' '.join(v.name for v in verbs)}' sessions=0 command=0
    case $verb in
{cases}    esac
    COMPREPLY=()
    if ((command)); then  # after `--`, a command line of its own
        for ((i = at + 1; i < COMP_CWORD; i++)); do
            [[ ${{COMP_WORDS[i]}} == -- ]] || continue
            if declare -F _command_offset >/dev/null; then
                _command_offset $((i + 1))
            elif ((i + 1 == COMP_CWORD)); then
                _escrowctl_add < <(compgen -c -- "$cur")
            else
                compopt -o bashdefault -o default 2>/dev/null
            fi
            return 0
        done
    fi
    local value=$cur nl=$'\\n'
    [[ $cur == --*=* ]] && value=${{cur#*=}}
    if [[ -n $prev && " $valued " == *" $prev "* ]]; then
        if [[ $prev == --socket ]]; then
            cur=$value _escrowctl_add < <(compgen -f -- "$value")
            [[ $value != "$cur" ]] && COMPREPLY=("${{COMPREPLY[@]/#/${{cur%%=*}}=}}")
        fi
    elif [[ $cur == -* ]]; then
        _escrowctl_add <<< "${{options// /$nl}}"
    else
        _escrowctl_add <<< "${{words// /$nl}}"
        ((sessions)) && _escrowctl_add < <(command escrowctl _complete sessions \\
            "${{COMP_WORDS[@]:1:COMP_CWORD-1}}" 2>/dev/null)
    fi
    # Readline replaces only what follows the last `:` or `=` of the word (COMP_WORDBREAKS):
    # each candidate loses what comes before it.
    local tail=$cur
    [[ $COMP_WORDBREAKS == *:* ]] && tail=${{tail##*:}}
    [[ $COMP_WORDBREAKS == *=* ]] && tail=${{tail##*=}}
    if [[ $tail != "$cur" ]]; then
        local before=${{cur%"$tail"}}
        COMPREPLY=("${{COMPREPLY[@]#"$before"}}")
    fi
    return 0
}}
complete -F _escrowctl escrowctl
"""


def _zsh_quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def _zsh_items(options: Sequence[Option]) -> str:
    return " ".join(_zsh_quote(f"{n}:{o.help}") for o in options for n in o.names)


def _zsh(top: Sequence[Option], verbs: Sequence[Verb]) -> str:
    cases = "".join(
        f"        ({v.name}) options=({_zsh_items(v.options)}); "
        f"valued=({' '.join(_valued(v.options))}); cands=({' '.join(v.choices)}); "
        f"sessions={int(v.sessions)}; command={int(v.command)} ;;\n"
        for v in verbs)
    commands = " ".join(_zsh_quote(f"{v.name}:{_short(v.help)}") for v in verbs)
    return f"""\
#compdef escrowctl
# zsh completion for escrowctl, written by `escrowctl completion zsh`: save it as _escrowctl
# in a directory of $fpath (before compinit runs), or source it after compinit.
_escrowctl() {{
    local verb='' i
    for ((i = 2; i < CURRENT; i++)); do
        case ${{words[i]}} in
            ({'|'.join(_valued(top)) or '--'}) ((i++)) ;;
            (-*) ;;
            (*) verb=${{words[i]}}; break ;;
        esac
    done
    local -a options valued cands ids
    local sessions=0 command=0
    options=({_zsh_items(top)})
    valued=({' '.join(_valued(top))})
    cands=({commands})
    case $verb in
{cases}    esac
    local dashdash=${{words[(ieb:i+1:)--]}}
    if (( command && dashdash < CURRENT )); then  # after `--`, a command line of its own
        shift $dashdash words
        (( CURRENT -= dashdash ))
        _normal
        return
    fi
    if (( ${{valued[(Ie)${{words[CURRENT-1]}}]}} )); then
        [[ ${{words[CURRENT-1]}} == --socket ]] && _files
        return
    fi
    if [[ $PREFIX == -* ]]; then
        _describe -t options option options
    elif [[ -z $verb ]]; then
        _describe -t commands 'escrowctl command' cands
    else
        (( ${{#cands}} )) && compadd -a cands
        if (( sessions )); then
            ids=(${{(f)"$(command escrowctl _complete sessions \\
                "${{(@)words[2,CURRENT-1]}}" 2>/dev/null)"}})
            (( ${{#ids}} )) && compadd -a ids
        fi
    fi
}}
if [[ ${{zsh_eval_context[-1]}} == loadautofunc ]]; then
    _escrowctl "$@"
else
    compdef _escrowctl escrowctl
fi
"""


def _fish_quote(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _fish_option(condition: str, option: Option) -> str:
    flags = "".join(f" -s {n[1:]}" if not n.startswith("--") else f" -l {n[2:]}"
                    for n in option.names)
    value = (" -r -F" if option.value == "PATH" else " -r") if option.value else ""
    return f"complete -c escrowctl -n {condition}{flags}{value} -d {_fish_quote(option.help)}\n"


def _fish(top: Sequence[Option], verbs: Sequence[Verb]) -> str:
    lines = [_fish_option("'not __escrowctl_verb'", o) for o in top]
    lines += [f"complete -c escrowctl -n 'not __escrowctl_verb' -a {v.name} "
              f"-d {_fish_quote(_short(v.help))}\n" for v in verbs]
    for v in verbs:
        condition = f"'__escrowctl_verb_is {v.name}'"
        lines += [_fish_option(condition, o) for o in v.options]
        if v.choices:
            lines.append(f"complete -c escrowctl -n {condition} -a '{' '.join(v.choices)}'\n")
        if v.sessions:
            lines.append(f"complete -c escrowctl -n {condition} -a '(__escrowctl_sessions)'\n")
        if v.command:
            lines.append(f"complete -c escrowctl -n 'test \"$(__escrowctl_verb)\" = {v.name}; "
                         "and __escrowctl_command >/dev/null' "
                         "-a '(__escrowctl_complete_command)'\n")
    top_valued = " ".join(_valued(top)) or "--"
    return f"""\
# fish completion for escrowctl, written by `escrowctl completion fish`: save it as
# ~/.config/fish/completions/escrowctl.fish
function __escrowctl_verb --description 'the verb on the command line, if any'
    set -l words (commandline -opc)
    set -e words[1]
    while set -q words[1]
        if contains -- $words[1] {top_valued}
            set -e words[1]
        else if not string match -q -- '-*' $words[1]
            echo $words[1]
            return 0
        end
        set -e words[1]
    end
    return 1
end
function __escrowctl_verb_is --description 'the verb is argv[1], and no `--` follows it'
    test "$(__escrowctl_verb)" = $argv[1]; and not __escrowctl_command >/dev/null
end
function __escrowctl_command --description 'the words after `--`, if there is one'
    set -l words (commandline -opc)
    set -l at (contains -i -- -- $words); or return 1
    set -e words[1..$at]
    string join \\n -- $words
    return 0
end
function __escrowctl_complete_command --description 'what follows `--`: a command line'
    set -l words (__escrowctl_command)
    complete -C "$(string join ' ' -- (string escape -- $words) '')$(commandline -ct)"
end
function __escrowctl_sessions --description 'the sessions a live holder holds'
    set -l words (commandline -opc)
    command escrowctl _complete sessions $words[2..-1] 2>/dev/null
end
complete -c escrowctl -f
{"".join(lines)}"""


class _Expired(Exception):
    """The Tab's whole second is up."""


def _expire(signum: int, frame: object) -> None:
    raise _Expired


def print_sessions(words: Sequence[str]) -> int:
    """`escrowctl _complete sessions WORDS...`: the id of each session a holder holds,
    one a line, on the socket `--socket` names in WORDS (else the default); nothing when
    no holder answers. Always 0.

    What a holder says is printed only when owner and id are protocol names: a shell
    that completes a word may run what is in it (bash's `compgen -W` expands `$(...)`),
    and a listener on the socket may say anything. Connect and list share one deadline,
    and an alarm bounds the whole: this process is the Tab's own, so its alarm is
    nobody else's."""
    import signal

    signal.signal(signal.SIGALRM, _expire)
    signal.setitimer(signal.ITIMER_REAL, SESSIONS_TIMEOUT + 0.2)
    try:
        print("".join(_sessions(_socket_on(words))), end="")
    except Exception:  # a Tab says nothing rather than an error into the line
        pass
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    return 0


def _socket_on(words: Sequence[str]) -> str | None:
    """The `--socket` on the line typed so far, as `--socket PATH`, `--socket=PATH`, or
    bash's `--socket = PATH` (its words break at `=`), with `~` as the shell would."""
    socket = None
    for i, word in enumerate(words):
        if word == "--socket" and i + 1 < len(words):
            rest = words[i + 1:]
            socket = rest[1] if rest[0] == "=" and len(rest) > 1 else rest[0]
        elif word.startswith("--socket="):
            socket = word.partition("=")[2]
    return os.path.expanduser(socket) if socket else None


def _sessions(socket: str | None) -> list[str]:
    from . import protocol
    from .channel import Deadline, connect
    from .paths import resolve_socket_path

    deadline = Deadline(SESSIONS_TIMEOUT)
    hello = protocol.Hello(version=protocol.VERSION, owner="escrowctl",
                           client="escrowctl completion", timeout=SESSIONS_TIMEOUT)
    with connect(resolve_socket_path(socket), hello, deadline) as channel:
        reply, _ = channel.call(protocol.List(all_owners=True), deadline)
    if not isinstance(reply, protocol.Sessions):
        return []
    return [f"{s.owner}/{s.id}\n" for s in reply.sessions
            if s.state not in protocol.TOMBSTONE_STATES
            and re.fullmatch(protocol.NAME_CHARS, s.owner)
            and re.fullmatch(protocol.NAME_CHARS, s.id)]
