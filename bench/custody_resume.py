"""How long an app's sessions are unprotected when the holder dies: from the SIGKILL of the
serving holder (under its keeper) to the app's `Custody` reporting that it holds custody
again on the keeper's next holder, and (the baseline, same run) from the SIGKILL to that
next holder answering `status` at all.

    .venv/bin/python bench/custody_resume.py [--runs 20] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

from escrow_client import EscrowClient, EscrowError

APP = textwrap.dedent("""
    import json, os, sys, time
    from escrow_client import EscrowClient
    master, slave = os.openpty()
    custody = EscrowClient("bench.resume", socket_path=sys.argv[1]).custody()
    custody.on_change(lambda ok: print(json.dumps({"protected": ok, "t": time.time()}),
                                       flush=True))
    custody.deposit("tab", master)
    print(json.dumps({"ready": True}), flush=True)
    sys.stdin.read()
""")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    directory = tempfile.mkdtemp(prefix="esc-resume-")
    sock = os.path.join(directory, "escrowd.sock")
    keeper = subprocess.Popen([sys.executable, "-m", "escrowd", "--socket", sock],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    admin = EscrowClient("bench.resume.admin", socket_path=sock, timeout=5.0)
    _until(lambda: _status(admin) is not None)
    app = subprocess.Popen([sys.executable, "-c", APP, sock], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)
    assert app.stdout is not None
    json.loads(app.stdout.readline())
    resumed, answered = [], []
    try:
        for _ in range(args.runs):
            before = _status(admin)
            assert before is not None
            killed = time.time()
            os.kill(before.pid, signal.SIGKILL)
            after = _until(lambda old=before.instance: _newer(admin, old))
            answered.append(after - killed)
            assert json.loads(app.stdout.readline())["protected"] is False
            back = json.loads(app.stdout.readline())
            assert back["protected"] is True
            resumed.append(back["t"] - killed)
    finally:
        app.kill()
        app.communicate()
        keeper.send_signal(signal.SIGTERM)
        keeper.wait(30)
    result = {
        "runs": args.runs,
        "custody_resumed_median_s": round(statistics.median(resumed), 3),
        "custody_resumed_max_s": round(max(resumed), 3),
        "baseline_next_holder_answers_median_s": round(statistics.median(answered), 3),
    }
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:40} {value}")
    return 0


def _status(admin: EscrowClient):  # type: ignore[no-untyped-def]
    try:
        return admin.status()
    except EscrowError:
        return None


def _newer(admin: EscrowClient, instance: str) -> float | None:
    status = _status(admin)
    return time.time() if status is not None and status.instance != instance else None


def _until(condition, timeout: float = 30.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.005)
    raise SystemExit("timed out")


if __name__ == "__main__":

    sys.exit(main())
