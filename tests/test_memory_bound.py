"""Memory bound under load (docs/design.md §3, "The drain").

500 sessions are escrowed and draining while every child writes 128-256 KiB as fast as it
can and exits. The holder runs with a 64 KiB per-session ring and a 4 MiB holder-wide cap,
so most of that output cannot be kept. What must hold:

- total ring storage (`ring_bytes_used`, and the sum of `buffered_bytes`) never exceeds the
  holder-wide cap, sampled while the children write and after they are done;
- no child ever blocks on a full terminal: every child exits on its own within a deadline
  while nobody but the holder reads its master;
- for every session, `buffered_bytes + dropped_bytes` is exactly what the child wrote, and
  a sample of replays are exactly the newest bytes written;
- once everything is released, the ring budget is back to 0 and the holder's fds back to
  their baseline (the `make_holder` fixture checks the fds).

Children run on raw slaves (no output processing, no echo), so bytes read from a master are
exactly the bytes the child wrote. Each waits for one byte of input before it writes, so all
of them are escrowed (draining) before any output exists. The holder's RSS and open fd count
before, at the peak and after are printed (docs/reliability.md quotes them).
"""

from __future__ import annotations

import os
import random
import resource
import subprocess
import threading
import time
import tty
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import OWNER, HolderProcess, PtyChild, _make_controlling_tty, wait_for
from escrow_client import EscrowClient, HolderStatus

SESSIONS = 500
RING = 64 << 10
TOTAL_CAP = 4 << 20
MIN_WRITE, MAX_WRITE = 128 << 10, 256 << 10
CHILD_DEADLINE = 40.0


def pattern(size: int) -> bytes:
    """Numbered records: any slice of it says where it came from."""
    return b"".join(b"%07d\n" % i for i in range(size // 8 + 1))[:size]


@pytest.fixture
def high_nofile() -> Iterator[None]:
    """RLIMIT_NOFILE raised to the hard limit for this test (a holder started meanwhile
    inherits it), and put back afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def spawn_raw(data_path: Path, size: int) -> PtyChild:
    """A child on a raw PTY that waits for one byte of input, then writes the first `size`
    bytes of `data_path` as fast as it can and exits."""
    master, slave = os.openpty()
    try:
        tty.setraw(slave)
        proc = subprocess.Popen(
            ["sh", "-c", 'head -c 1 >/dev/null && exec head -c "$1" "$0"', str(data_path),
             str(size)],
            stdin=slave, stdout=slave, stderr=slave, preexec_fn=_make_controlling_tty,
            close_fds=True,
        )
    except BaseException:
        os.close(master)
        raise
    finally:
        os.close(slave)
    return PtyChild(master, proc)


class Sampler(threading.Thread):
    """Asks the holder for its status in a loop and keeps the peaks."""

    def __init__(self, admin: EscrowClient, before: HolderStatus) -> None:
        super().__init__(daemon=True)
        self.admin = admin
        self.samples = self.peak_used = 0
        self.peak_rss = before.rss_bytes or 0
        self.peak_fds = before.open_fds or 0
        self.over_cap: list[int] = []
        self._halt = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self._halt.is_set():
                status = self.admin.status()
                used = status.counters["ring_bytes_used"]
                self.samples += 1
                self.peak_used = max(self.peak_used, used)
                self.peak_rss = max(self.peak_rss, status.rss_bytes or 0)
                self.peak_fds = max(self.peak_fds, status.open_fds or 0)
                if used > TOTAL_CAP:
                    self.over_cap.append(used)
        except BaseException as exc:  # reported by stop()
            self.error = exc

    def stop(self) -> None:
        self._halt.set()
        self.join(15)
        assert not self.is_alive(), "the status sampler did not stop"
        if self.error is not None:
            raise AssertionError(f"status sampling failed: {self.error!r}")


def _mib(n: int | None) -> str:
    return "?" if n is None else f"{n / (1 << 20):.1f} MiB"


def test_500_draining_sessions_stay_under_the_holder_wide_cap(
    high_nofile: None, make_holder, tmp_path: Path
) -> None:
    needed = SESSIONS * 2 + 200
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert soft == resource.RLIM_INFINITY or soft >= needed, (
        f"RLIMIT_NOFILE {soft} is too low for {SESSIONS} sessions")
    holder: HolderProcess = make_holder(
        "--ring-bytes", str(RING), "--total-ring-bytes", str(TOTAL_CAP), "--max-sessions", "1000"
    )
    client = holder.client(OWNER, timeout=10.0)
    admin = holder.client("escrowctl", timeout=10.0)
    before = admin.status()

    data = pattern(MAX_WRITE)
    data_path = tmp_path / "pattern"
    data_path.write_bytes(data)
    rng = random.Random(4)
    sizes = {f"s{i:03d}": rng.randint(MIN_WRITE, MAX_WRITE) for i in range(SESSIONS)}

    children: dict[str, PtyChild] = {}
    t0 = time.monotonic()
    try:
        for sid, size in sizes.items():
            children[sid] = spawn_raw(data_path, size)
        t_spawned = time.monotonic()
        # One custody for all: while it lasts the holder does not touch the masters; when it
        # closes, all 500 start draining at once.
        with client.custody() as custody:
            for sid, child in children.items():
                custody.deposit(sid, child.master, child_pid=child.pid, label="flood")
        infos = {s.id: s for s in client.list()}
        assert len(infos) == SESSIONS
        assert {s.state for s in infos.values()} == {"draining"}

        # Go: one byte of input each (writing is not reading: the holder stays the only
        # reader), then drop the app's copy of every master.
        for child in children.values():
            os.write(child.master, b"g")
            os.close(child.master)
            child.master = -1
        t_go = time.monotonic()

        # While they write: sample the holder-wide figures until every child has exited
        # (status in a thread of its own, as often as it answers; list here, in between).
        sampler = Sampler(admin, before)
        sampler.start()
        buffered_samples = 0
        peak_buffered = 0
        running = dict(children)
        try:
            while running:
                buffered = sum(s.buffered_bytes for s in client.list())
                buffered_samples += 1
                peak_buffered = max(peak_buffered, buffered)
                assert buffered <= TOTAL_CAP, f"buffered {buffered} B is over the cap"
                assert holder.alive()
                for sid in [s for s, c in running.items() if c.proc.poll() is not None]:
                    assert running.pop(sid).proc.returncode == 0, f"child {sid} failed"
                assert time.monotonic() - t_go < CHILD_DEADLINE, (
                    f"{len(running)} children still blocked {CHILD_DEADLINE}s after they "
                    f"were started, with only the holder reading them: "
                    f"e.g. {sorted(running)[:5]}")
        finally:
            sampler.stop()
        assert sampler.over_cap == [], f"ring storage over the cap: {sampler.over_cap[:5]}"
        peak_used, peak_rss, peak_fds = sampler.peak_used, sampler.peak_rss, sampler.peak_fds
        samples = sampler.samples
        t_exited = time.monotonic()

        # Drain first, then mark: each becomes `exited` only once its whole tail is in.
        def all_exited() -> bool:
            return all(s.state == "exited" for s in client.list())

        wait_for(all_exited, 20.0, "every session to be exited")
        infos = {s.id: s for s in client.list()}
        status = admin.status()
        buffered = sum(s.buffered_bytes for s in infos.values())
        used = status.counters["ring_bytes_used"]
        assert used <= TOTAL_CAP and buffered <= used
        wrong = {sid: (infos[sid].buffered_bytes, infos[sid].dropped_bytes, size)
                 for sid, size in sizes.items()
                 if infos[sid].buffered_bytes + infos[sid].dropped_bytes != size}
        assert not wrong, f"buffered + dropped != written for {len(wrong)} sessions: " + str(
            dict(list(wrong.items())[:5]))
        assert all(info.buffered_bytes <= RING for info in infos.values())
        kept = sum(1 for info in infos.values() if info.buffered_bytes > 0)

        # A sample of replays, biggest rings first: exactly the newest bytes written.
        sample = sorted(infos, key=lambda s: -infos[s].buffered_bytes)[:10] + [
            sid for sid in infos if infos[sid].buffered_bytes == 0][:5]
        for sid in sample:
            got = client.retrieve(sid)
            try:
                assert got.confirmed and got.session.state == "exited"
                assert got.dropped_bytes == infos[sid].dropped_bytes
                assert got.replay == data[sizes[sid] - len(got.replay):sizes[sid]], sid
                assert len(got.replay) + got.replay_trimmed == infos[sid].buffered_bytes
            finally:
                os.close(got.fd)

        for sid in sizes:
            if sid not in sample:
                client.release(sid)
        after = admin.status()
        assert after.counters["ring_bytes_used"] == 0
        assert not [s for s in client.list() if s.state in ("draining", "exited", "held")]
        holder.wait_fds_at_baseline()
        after = admin.status()
        t_end = time.monotonic()

        written = sum(sizes.values())
        # Fair shares: the sessions that asked first did not take the whole cap and leave
        # the others with no replay at all.
        assert kept == SESSIONS, f"only {kept} of {SESSIONS} sessions kept any replay"
        print(
            f"\n  {SESSIONS} sessions, {written / (1 << 20):.1f} MiB written in "
            f"{t_exited - t_go:.2f}s (spawn {t_spawned - t0:.2f}s, total {t_end - t0:.2f}s); "
            f"{samples} status and {buffered_samples} list samples while writing"
            f"\n  ring storage peak {peak_used} B, buffered peak {peak_buffered} B "
            f"(cap {TOTAL_CAP} B); at the end buffered {buffered} B in {kept} sessions, "
            f"dropped {sum(i.dropped_bytes for i in infos.values())} B"
            f"\n  holder RSS before {_mib(before.rss_bytes)}, peak {_mib(peak_rss)}, "
            f"after {_mib(after.rss_bytes)}"
            f"\n  holder open fds before {before.open_fds}, peak {peak_fds}, "
            f"after {after.open_fds}"
        )
    finally:
        for child in children.values():
            child.kill()
            if child.master >= 0:
                os.close(child.master)
