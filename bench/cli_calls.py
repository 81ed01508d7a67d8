"""What an `escrowctl` call costs its user: `status`, `list` and `--version` from exec to
exit, against `python -c pass` from the same interpreter, in interleaved rounds.

A person types these at a prompt, and scripts call them in loops, so the time that counts
is the whole process: the interpreter's start, the console script, every import, the
connection, the holder's answer and the printing. The baseline is the start of the same
interpreter doing nothing; `tmux has-session` (when tmux is installed) is the peer a user
compares with.

They run as a user's install runs them, not the checkout's editable one (whose finder adds
its own imports to every start, the baseline's too): a virtual environment made here, with
a copy of `escrow_client` in its site-packages, this environment's dependencies reachable
after it, and the console script pip wrote for this checkout (`.venv/bin/escrowctl`) with
its interpreter line pointing there. The holder has `SESSIONS` draining sessions, so that
`list` prints a table of a few rows and `status` sums their replays.

    .venv/bin/python bench/run.py --only cli
    .venv/bin/python bench/cli_calls.py [--runs N] [--escrowctl PATH]

`--escrowctl` times another console script instead (the same calls against the same
holder), for paired runs of two versions of the code.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from holder import BenchHolder

import escrow_client

SESSIONS = 10
RUNS = 15
# pip's console script, as it writes one, for when this checkout has none.
_SCRIPT = """#!{python}
import sys
from escrow_client.cli import main
if __name__ == '__main__':
    sys.argv[0] = sys.argv[0].removesuffix('.exe')
    sys.exit(main())
"""


def user_install(where: Path) -> tuple[Path, Path]:
    """A user's install of escrowctl in `where`: (its interpreter, its console script)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True,
                   capture_output=True, timeout=60)
    python = where / "bin" / "python"
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    site = where / "lib" / version / "site-packages"
    shutil.copytree(Path(escrow_client.__file__).parent, site / "escrow_client",
                    ignore=shutil.ignore_patterns("__pycache__", "c"))
    # A path in a .pth file is added without its own .pth files: the dependencies come
    # from this environment, its editable install of the checkout does not.
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip_script = Path(sys.executable).parent / "escrowctl"
    body = (pip_script.read_text().split("\n", 1)[1] if pip_script.exists()
            else _SCRIPT.split("\n", 1)[1])
    script = where / "bin" / "escrowctl"
    script.write_text(f"#!{python}\n{body}")
    script.chmod(0o755)
    # The first run compiles the copy's bytecode; a user's later runs find it there.
    subprocess.run([python, "-c", "import escrow_client.cli"], check=True, timeout=60)
    return python, script


@contextlib.contextmanager
def holder_with_sessions(count: int) -> Iterator[BenchHolder]:
    """A bare holder with `count` draining sessions, each with a line of replay."""
    with BenchHolder(log_path=os.devnull, name="cli") as holder:
        client = holder.client("bench.cli")
        ptys = [os.openpty() for _ in range(count)]
        try:
            with client.custody() as custody:
                for i, (master, _) in enumerate(ptys):
                    custody.deposit(f"tab-{i}", master, label=f"shell {i}")
            for _, slave in ptys:
                os.write(slave, b"$ ls\r\n")
            yield holder
        finally:
            for master, slave in ptys:
                os.close(master)
                os.close(slave)


@contextlib.contextmanager
def tmux_server() -> Iterator[list[str] | None]:
    """`tmux has-session` against a server of its own with one session, or None without
    tmux."""
    tmux = shutil.which("tmux")
    if tmux is None:
        yield None
        return
    name = f"esc-bench-{os.getpid()}"
    base = [tmux, "-L", name, "-f", os.devnull]
    started = subprocess.run([*base, "new-session", "-d", "-s", "bench"],
                             capture_output=True, timeout=30).returncode == 0
    try:
        yield [*base, "has-session", "-t", "bench"] if started else None
    finally:
        subprocess.run([*base, "kill-server"], capture_output=True, timeout=30)


def exec_to_exit_ms(argv: Sequence[str | Path], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run([str(a) for a in argv], stdin=subprocess.DEVNULL,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, check=False)
    return (time.perf_counter() - start) * 1e3


def time_calls(python: Path, escrowctl: Path, socket_path: str, runs: int,
               tmux: list[str] | None) -> dict[str, list[float]]:
    """Each call `runs` times, in rounds that take each in turn (a machine that slows down
    for a while slows them all alike)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["ESCROW_SOCKET"] = socket_path
    calls: dict[str, list[str | Path]] = {
        "python": [python, "-c", "pass"],
        "status": [escrowctl, "status"],
        "list": [escrowctl, "list"],
        "version": [escrowctl, "--version"],
    }
    if tmux is not None:
        calls["tmux"] = tmux
    for name, argv in calls.items():  # warm the page cache, and see that each works
        done = subprocess.run([str(a) for a in argv], stdin=subprocess.DEVNULL,
                              capture_output=True, env=env, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"{name}: {argv} exited {done.returncode}: {done.stderr!r}")
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(runs):
        for name, argv in calls.items():
            times[name].append(exec_to_exit_ms(argv, env))
    return times


def bench_cli(runs: int = RUNS, escrowctl: Path | None = None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="esc-bench-cli-") as tmp:
        python, script = user_install(Path(tmp) / "venv")
        if escrowctl is not None:
            script = escrowctl
        with holder_with_sessions(SESSIONS) as holder, tmux_server() as tmux:
            times = time_calls(python, script, holder.socket, runs, tmux)
    med = {name: float(statistics.median(values)) for name, values in times.items()}
    result: dict[str, Any] = {"cli_python_ms": med["python"], "cli_runs": runs,
                              "cli_sessions": SESSIONS}
    for name in ("status", "list", "version"):
        result[f"cli_{name}_ms"] = med[name]
        result[f"cli_{name}_vs_python"] = med[name] / med["python"]
    if "tmux" in med:
        result["cli_tmux_has_session_ms"] = med["tmux"]
    return result


def rows(r: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """run.py's table rows: (name, figure, baseline, ratio, target key)."""
    python = f"python -c pass {r['cli_python_ms']:,.0f} ms"
    out = [(f"escrowctl {what}", f"{r[f'cli_{key}_ms']:,.0f} ms", python,
            f"{r[f'cli_{key}_vs_python']:,.1f}×", f"cli_{key}_vs_python")
           for what, key in (("status", "status"), ("list (10 sessions)", "list"),
                             ("--version", "version"))]
    if "cli_tmux_has_session_ms" in r:
        out.append(("tmux has-session (peer)", "",
                    f"{r['cli_tmux_has_session_ms']:,.0f} ms", "", ""))
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=RUNS)
    parser.add_argument("--escrowctl", type=Path, metavar="PATH",
                        help="time this console script instead of a fresh user's install")
    args = parser.parse_args(argv)
    print(json.dumps(bench_cli(args.runs, args.escrowctl)))


if __name__ == "__main__":
    main()
