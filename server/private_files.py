"""Files that hold a secret (the admin token, a config that may carry it): private to the running user.

``write_private`` publishes a file atomically (temporary file in the same folder, fsync, rename), created
``0600`` from the first byte — never written world-readable and chmod-ed afterwards, which leaves a window
another local user can open the file in. ``private_dir`` makes a ``0700`` folder, or checks that an
existing one is ours and not open to others.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path


class UnsafePath(Exception):
    """A folder or file we would trust is owned by someone else or writable by others."""


def write_private(path: str | os.PathLike[str], text: str) -> None:
    """Atomically write ``text`` to ``path`` with mode 0600 (a reader never sees half a file)."""
    final = Path(path)
    tmp = final.with_name(f".{final.name}.tmp.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)  # O_TRUNC on a leftover of ours keeps its old mode: set it anyway
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_ready_file(path: str | None, payload: dict) -> None:
    """Atomically publish ``payload`` (tmp file + rename): a reader never sees half a file. Mode 0600
    from the first byte: ``distserve serve``'s ready file holds the admin token. Here, not in the router's
    modules, so the launcher writes it without importing the router's HTTP stack (0.6 s of CPU)."""
    if not path:
        return
    write_private(path, json.dumps(payload))


def private_dir(path: str | os.PathLike[str]) -> Path:
    """``path`` as a folder of ours, mode 0700 (created if missing); :class:`UnsafePath` if it is not ours."""
    p = Path(path)
    p.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(p)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePath(f"{p} is not a folder")
    if st.st_uid != os.geteuid():
        raise UnsafePath(f"{p} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})")
    if st.st_mode & 0o077:
        os.chmod(p, 0o700)  # ours: close it
    return p


def check_private_file(path: str | os.PathLike[str]) -> None:
    """Raise :class:`UnsafePath` unless ``path`` is a regular file owned by us and not writable by others."""
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePath(f"{path} is not a regular file")
    if st.st_uid != os.geteuid():
        raise UnsafePath(f"{path} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})")
    if st.st_mode & 0o022:
        raise UnsafePath(f"{path} is writable by other users (mode {stat.S_IMODE(st.st_mode):o})")
