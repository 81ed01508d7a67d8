"""A state file's memory: the file itself, and its mapping, with one fd for both.

A session costs the holder two fds, its PTY master and its state file, and no more: Python's
`mmap.mmap` keeps a duplicate of the fd it maps for as long as the mapping lives (3.11 has
no `trackfd`), which made three. So the file is mapped here with libc's own `mmap` (through
ctypes), which keeps nothing open, and read and written through a memoryview over the
mapping. The state file keeps its one fd, which is also the one the fd store is sent.

Unmapping is where such a mapping can hurt: memory a view still points at must never go
away under it, or the holder reads an unmapped page and dies of SIGSEGV, with every session.
Every view of the mapping is a memoryview over one ctypes array, and each holds a reference
to that array. `close` releases the views it made itself, then unmaps only if nothing else
holds the array (its reference count is known exactly); if anything does (a view somebody
kept, a traceback's frame), the pages are replaced by private zero pages at the same address
instead of unmapped: the file's memory is let go all the same, and a forgotten view reads
zeros rather than crash the holder. Those pages are read-only and reserve nothing
(PROT_READ, MAP_NORESERVE), so that no commit limit can refuse them (strict overcommit
charges a writable private mapping in full); if the kernel refuses them all the same, the
shared mapping stays where it is, leaked and logged, rather than be unmapped under the
view. (Nothing writes through a view past its close: the ring that made it is released.)
The range is never unmapped after that: the view may outlive anything that could tell.

The platform differences are here too: a sealed memfd on Linux; on macOS, which has none,
an unlinked file in the holder's private (0700) directory. libc's `mmap` and `memchr` are
the same on both.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import tempfile

from .log import log

_libc = ctypes.CDLL(None, use_errno=True)
_mmap = _libc.mmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                  ctypes.c_int64]
_munmap = _libc.munmap
_munmap.restype = ctypes.c_int
_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_memchr = _libc.memchr
_memchr.restype = ctypes.c_void_p
_memchr.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED = 0x10  # the same on Linux and macOS; Python's mmap module does not name it
_READ_WRITE = mmap.PROT_READ | mmap.PROT_WRITE
# Python's mmap module does not name it (Linux's value; macOS's, which it ignores, is 0x40).
_MAP_NORESERVE = 0x4000 if sys.platform == "linux" else 0x40
# References to the array when nobody but the mapping holds it: its own attribute, and
# getrefcount's argument.
_UNSHARED = 2


def new_file(name: str, private_dir: str | None) -> int:
    """A new, empty file for shared memory, close-on-exec: a memfd that may be sealed, or
    on macOS an unlinked file in `private_dir`."""
    if sys.platform == "linux":
        return os.memfd_create(f"escrowd:{name}"[:249], os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    fd, path = tempfile.mkstemp(prefix=".state-", dir=private_dir)
    os.unlink(path)
    return fd


class Mapping:
    """`length` bytes of `fd` mapped shared, read and write; `view` is a memoryview of
    them (format "B"). Owns the mapping, not the fd: the fd may be closed at once."""

    __slots__ = ("view", "_array", "_address", "_length")

    def __init__(self, fd: int, length: int) -> None:
        address = _mmap(None, length, _READ_WRITE, mmap.MAP_SHARED, fd, 0)
        if address is None or address == _MAP_FAILED:
            error = ctypes.get_errno()
            raise OSError(error, os.strerror(error))
        self._address: int = address
        self._length = length
        self._array: ctypes.Array[ctypes.c_ubyte] | None = (
            (ctypes.c_ubyte * length).from_address(address))
        self.view = memoryview(self._array).cast("B")

    def find(self, byte: int, start: int, end: int) -> int:
        """Where `byte` first is in `view[start:end]` (an offset into `view`), or -1: a
        memchr, as `mmap.find` is."""
        if start >= end:
            return -1
        found = _memchr(self._address + start, byte, end - start)
        return -1 if found is None else found - self._address

    def close(self) -> None:
        """Let the file's memory go (idempotent); the caller has released every view it
        made from `view`. See the module's docstring for what a view kept elsewhere gets."""
        array = self._array
        if array is None:
            return
        try:
            self.view.release()
        except BufferError:  # exported right now: the array is not ours alone, see below
            pass
        self._array = None
        if sys.getrefcount(array) <= _UNSHARED:
            _munmap(self._address, self._length)
        else:
            zeros = _mmap(self._address, self._length, mmap.PROT_READ,
                          mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED | _MAP_NORESERVE,
                          -1, 0)
            if zeros != self._address:  # refused: the shared pages stay (never unmapped)
                error = ctypes.get_errno()
                log("internal_error", where="shm", error=os.strerror(error),
                    action=f"a state file's {self._length} B mapping kept")
