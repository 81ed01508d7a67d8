"""The platform module's macOS branches, where their logic can run on Linux: the layouts of
`struct xucred` (LOCAL_PEERCRED) and `struct flock` (F_GETLK) are parsed by pure functions,
checked here with bytes laid out as macOS lays them out. (The system calls themselves are
type-checked with `mypy --platform darwin` in scripts/test; they cannot run here.)
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct

import pytest

from escrow_client import platform


def xucred(version: int, uid: int, groups: list[int]) -> bytes:
    """A macOS `struct xucred` as the kernel fills it: u_int cr_version; uid_t cr_uid;
    short cr_ngroups; (2 bytes of padding) gid_t cr_groups[16]."""
    padded = groups + [0] * (16 - len(groups))
    return struct.pack("=IIh2x16I", version, uid, len(groups), *padded)


def test_xucred_uid_reads_the_uid_field() -> None:
    raw = xucred(0, 501, [20, 12, 61])
    assert len(raw) == 76  # what LOCAL_PEERCRED returns on macOS
    assert platform.xucred_uid(raw) == 501
    assert platform.xucred_uid(xucred(0, 0, [])) == 0


def test_xucred_that_cannot_be_read_is_an_error_never_a_uid() -> None:
    with pytest.raises(OSError) as short:
        platform.xucred_uid(b"\0" * 6)
    assert short.value.errno == errno.EINVAL
    with pytest.raises(OSError):
        platform.xucred_uid(xucred(1, 501, []))  # a layout version we do not know


@pytest.mark.parametrize("name", ["linux", "darwin"])
def test_flock_layouts_ask_for_a_whole_file_write_lock(name: str) -> None:
    query = platform.flock_query(name)
    if name == "darwin":
        # {off_t l_start, l_len; pid_t l_pid; short l_type, l_whence}: 24 bytes.
        assert len(query) == 24
        start, length, pid, l_type, whence = struct.unpack("=qqihh", query)
    else:
        # {short l_type, l_whence; off_t l_start, l_len; pid_t l_pid} (+ padding): 32 bytes.
        assert len(query) == 32
        l_type, whence, start, length, pid = struct.unpack("@hhqqi4x", query)
    assert (l_type, whence, start, length, pid) == (fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)


def test_flock_holder_reads_the_pid_or_free() -> None:
    darwin_held = struct.pack("=qqihh", 0, 0, 4242, fcntl.F_WRLCK, os.SEEK_SET)
    darwin_free = struct.pack("=qqihh", 0, 0, 0, fcntl.F_UNLCK, os.SEEK_SET)
    assert platform.flock_holder("darwin", darwin_held) == 4242
    assert platform.flock_holder("darwin", darwin_free) is None
    linux_held = struct.pack("@hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 4242)
    assert platform.flock_holder("linux", linux_held) == 4242


def test_terminal_identity_tells_ptys_apart_and_a_pty_from_itself() -> None:
    m1, s1 = os.openpty()
    m2, s2 = os.openpty()
    try:
        one, two = platform.terminal_identity(m1), platform.terminal_identity(m2)
        assert one is not None and two is not None and one != two
        fds = len(os.listdir("/proc/self/fd"))
        assert platform.terminal_identity(m1) == one
        assert len(os.listdir("/proc/self/fd")) == fds  # the slave it looked at is closed
        assert one == (os.fstat(s1).st_dev, os.fstat(s1).st_rdev)  # the slave's device
    finally:
        for fd in (m1, s1, m2, s2):
            os.close(fd)


def test_terminal_identity_out_of_fds_is_an_error_not_a_guess() -> None:
    """Out of fds, TIOCGPTPEER fails with EMFILE: a fallback to the pts number would give
    the same terminal a second identity, letting it in under two ids. It raises instead
    (the holder answers `limit`)."""
    import resource

    master, slave = os.openpty()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        lowest_free = next(n for n in range(hard) if not _is_open(n))
        resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))  # no fd can open
        with pytest.raises(OSError) as out:
            platform.terminal_identity(master)
        assert out.value.errno == errno.EMFILE
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        os.close(master)
        os.close(slave)


def _is_open(fd: int) -> bool:
    try:
        fcntl.fcntl(fd, fcntl.F_GETFD)
    except OSError:
        return False
    return True
