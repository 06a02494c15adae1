"""KV shm segments whose creator died together with its resource tracker are removed at the next start:
only this user's, only when the pid in the name no longer exists."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys

import pytest

from distserve.server.kv_transfer.shm import SEGMENT_NAME_RE, create_segment, destroy_segment
from distserve.server.preflight import SHM_PREFIX, sweep_orphan_segments


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _plant(pid: int) -> str:
    name = f"{SHM_PREFIX}{pid}_{secrets.token_hex(16)}"
    fd = os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    os.write(fd, b"kv")
    os.close(fd)
    return name


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_orphan_segments_are_swept_and_live_ones_kept():
    seg = create_segment(64)
    assert SEGMENT_NAME_RE.fullmatch(seg.name) and seg.name.startswith(f"{SHM_PREFIX}{os.getpid()}_")
    orphan, live = _plant(_dead_pid()), _plant(os.getpid())
    foreign = _plant(_dead_pid())
    try:
        if os.geteuid() == 0:  # another user's orphan is theirs to clean
            import pwd

            os.chown(f"/dev/shm/{foreign}", pwd.getpwnam("nobody").pw_uid, -1)
        removed = sweep_orphan_segments()
        assert orphan in removed and not os.path.exists(f"/dev/shm/{orphan}")
        assert live not in removed and os.path.exists(f"/dev/shm/{live}")
        assert seg.name not in removed and os.path.exists(f"/dev/shm/{seg.name}")
        if os.geteuid() == 0:
            assert os.path.exists(f"/dev/shm/{foreign}")
    finally:
        destroy_segment(seg)
        for n in (orphan, live, foreign):
            try:
                os.unlink(f"/dev/shm/{n}")
            except FileNotFoundError:
                pass
