"""Short runs of the chaos and concurrency soaks (bench/chaos.py, bench/concurrency.py), the
chaos also with the holder SIGKILLed under its keeper (--kill-holder).

Each runs as a subprocess, exactly as by hand, against a holder of its own, and prints one
JSON object; every invariant counter in it must be 0. The long runs (2,000 chaos cycles,
50 clients for a minute) are run by hand; their figures are in docs/reliability.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent.parent / "bench"


def run_bench(script: str, *args: str, timeout: float = 90.0) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), *args, "--json"],
        capture_output=True, text=True, timeout=timeout,
    )
    lines = proc.stdout.strip().splitlines()
    assert lines, f"{script} printed nothing (exit {proc.returncode}): {proc.stderr[-3000:]}"
    result: dict[str, Any] = json.loads(lines[-1])
    print(f"\n  {script}: {json.dumps(result)}")
    if proc.stderr.strip():
        print(f"  stderr: {proc.stderr[-3000:]}")
    return result | {"exit_status": proc.returncode}


def test_chaos_soak_kills_clients_at_every_step_without_loss() -> None:
    """SIGKILL a client at a random step of 100 handoff cycles, with 4 shells in play: the
    holder survives, no session is lost or handed off twice, no fd leaks, and every shell's
    numbered output is contiguous across all cycles."""
    result = run_bench("chaos.py", "--cycles", "100")
    assert result["cycles"] == 100
    for counter in ("sessions_lost", "fds_leaked", "holder_died", "duplicate_handoffs",
                    "sequence_gaps", "replay_mismatches", "bad_fds"):
        assert result[counter] == 0, (counter, result)
    assert result["victim_errors"] == {}, result
    assert result["internal_errors_logged"] == 0, result
    # Every kill point was exercised, and the sessions really were checked.
    assert all(n > 0 for n in result["kills"].values()), result["kills"]
    assert result["lines_checked"] > 0 and result["checks"] >= 4
    assert result["handoffs_by_holder"] == result["acks_sent"]
    assert result["exit_status"] == 0


def test_chaos_soak_with_the_holder_sigkilled_loses_nothing() -> None:
    """The same under the keeper, the serving holder SIGKILLed at random moments (a few
    times in 30 cycles): every session is adopted by the next holder, none lost or handed
    off twice, neither the keeper nor the last holder leaks an fd, and every break in a
    shell's numbered output is where the holder marked `replay_gap_at`."""
    result = run_bench("chaos.py", "--cycles", "30", "--kill-holder", "--kill-every", "6",
                       "--ack-deadline", "1")
    assert result["cycles"] == 30
    for counter in ("sessions_lost", "fds_leaked", "holder_died", "duplicate_handoffs",
                    "sequence_gaps", "replay_mismatches", "bad_fds"):
        assert result[counter] == 0, (counter, result)
    assert result["victim_errors"] == {}, result
    assert result["internal_errors_logged"] == 0, result
    assert result["holder_kills"] >= 2, result
    # (a holder killed before it recorded its start is not counted as a restart)
    assert 1 <= result["unclean_restarts"] <= result["holder_kills"], result
    assert result["keeper_fds_after"] == result["keeper_fds_before"], result
    assert result["lines_checked"] > 0 and result["checks"] >= 2
    assert result["handoffs_by_holder"] == result["acks_sent"]
    assert result["exit_status"] == 0


def test_concurrency_smoke() -> None:
    """10 clients depositing, writing, listing, retrieving and releasing for 5 s: the same
    invariants, and no error at all (no client touches another's sessions)."""
    result = run_bench("concurrency.py", "--clients", "10", "--seconds", "5")
    for counter in ("holder_died", "sessions_lost", "bad_states", "duplicate_handoffs",
                    "replay_mismatches", "sequence_gaps", "fds_leaked", "unexpected_errors",
                    "bench_crashes"):
        assert result[counter] == 0, (counter, result)
    assert result["errors"] == {}, result
    assert result["internal_errors_logged"] == 0, result
    for kind in ("deposit", "write", "retrieve", "release", "list", "status"):
        assert result["ops"].get(kind, 0) > 0, (kind, result["ops"])
    assert result["lines_checked"] > 0
    assert result["handoffs_by_holder"] == result["acks"]
    assert result["exit_status"] == 0
