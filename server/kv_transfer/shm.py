"""POSIX shared-memory segments for same-host KV transfer.

Ownership is one-sided: the *sender* creates a segment (unpredictable name, mode 0600) and is the
only one that unlinks it. Python's `resource_tracker` is told about the segment in the sender only,
so a crashed sender still gets its segments cleaned up. The *receiver* attaches read-only and
untracked: on Python < 3.13 `SharedMemory(name)` registers every attach with the tracker, which then
unlinks the sender's segment when the receiver exits (and warns about a "leak"). Registering and
then unregistering is not enough when sender and receiver share one tracker (same process, or
multiprocessing children): the second UNREGISTER makes the tracker print a KeyError. So the receiver
never goes through the tracker at all: it calls shm_open itself.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import secrets
from multiprocessing import shared_memory

from distserve.server.preflight import SHM_PREFIX

try:  # the C module behind SharedMemory on POSIX; present on CPython 3.8+
    import _posixshmem
except ImportError:  # pragma: no cover - non-POSIX
    _posixshmem = None

SEGMENT_NAME_RE = re.compile(r"[A-Za-z0-9_]{8,64}")
_PREFIX_RE = re.compile(r"[A-Za-z0-9_]{1,24}")
DEFAULT_PREFIX = SHM_PREFIX  # names: <prefix><creator pid>_<32 hex> (server/preflight.py sweeps orphans)


def create_segment(nbytes: int, prefix: str = DEFAULT_PREFIX) -> shared_memory.SharedMemory:
    """A new segment of at least nbytes (>= 1: POSIX refuses empty mappings), random name."""
    if not _PREFIX_RE.fullmatch(prefix):
        raise ValueError(f"shm prefix {prefix!r} must match {_PREFIX_RE.pattern}")
    size = max(nbytes, 1)
    try:
        st = os.statvfs("/dev/shm")
        free = st.f_bavail * st.f_frsize
    except OSError:  # pragma: no cover - no /dev/shm (non-Linux): fallocate below still guards
        free = size
    if size > free:
        raise OSError(errno.ENOSPC, f"/dev/shm has {free} bytes free, KV segment needs {size}")
    while True:
        name = f"{prefix}{os.getpid()}_{secrets.token_hex(16)}"  # the owner's pid: see sweep_orphan_segments
        try:
            seg = shared_memory.SharedMemory(name=name, create=True, size=size)
            break
        except FileExistsError:  # pragma: no cover - 128 random bits
            continue
    # Reserve the pages now: tmpfs hands out pages lazily, and a write to a mapped page that
    # /dev/shm cannot back is SIGBUS — a dead prefill worker — instead of an OSError here.
    try:
        fd = getattr(seg, "_fd", -1)  # private but present on CPython 3.8-3.13
        if fd >= 0:
            os.posix_fallocate(fd, 0, size)
    except OSError:
        destroy_segment(seg)
        raise
    return seg


def destroy_segment(seg: shared_memory.SharedMemory) -> None:
    """Close and unlink; tolerant of a segment already unlinked by someone else."""
    try:
        seg.close()
    finally:
        try:
            seg.unlink()
        except FileNotFoundError:
            pass


class AttachedSegment:
    """Read-only, untracked view of a segment another process owns. Use as a context manager."""

    def __init__(self, name: str, min_size: int):
        self.buf: memoryview | None = None
        if not isinstance(name, str) or not SEGMENT_NAME_RE.fullmatch(name):
            raise ValueError(f"invalid shm segment name {name!r}")
        if _posixshmem is None:  # pragma: no cover
            raise OSError("POSIX shared memory is not available on this platform")
        fd = _posixshmem.shm_open("/" + name, os.O_RDONLY, mode=0o600)
        try:
            size = os.fstat(fd).st_size
            if size < max(min_size, 1):
                raise ValueError(f"shm segment {name} is {size} bytes, need {min_size}")
            self._mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self.buf = memoryview(self._mmap)

    def close(self) -> None:
        if self.buf is not None:
            self.buf.release()
            self.buf = None
            self._mmap.close()

    def __enter__(self) -> AttachedSegment:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
