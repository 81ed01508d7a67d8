"""Handoff latency against a raw fd round trip, measured in the same run.

    .venv/bin/python bench/handoff_latency.py [--rounds N] [--json]

Benchmark 1 of `bench/run.py` on its own (the code lives there): a real holder, a session
with 64 KiB of replay, `retrieve` timed from this process many times, beside one fd sent to
another process over a socketpair and back (C when a compiler is present, else Python).
It reports; it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import tempfile

from run import bench_handoff, compile_baselines


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="esc-bench-c-") as tmp:
        result = bench_handoff(compile_baselines(tmp), args.rounds)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:24} {value:.3f}" if isinstance(value, float) else f"{key:24} {value}")


if __name__ == "__main__":
    main()
