"""Atomic file writes for every harness package (distbench, sla, reports, chaos, ci).

A temporary file in the same folder (same filesystem, so the rename is atomic), flushed and fsynced,
then ``os.replace``: a reader, a crash or a Ctrl-C never sees half a report. The server keeps its own
two-line version for its ready file (``server`` never imports the harness).
"""

from __future__ import annotations

import os
from pathlib import Path


def atomic_write(path: str | Path, data: bytes | str) -> Path:
    """Write ``data`` to ``path`` atomically (parents created); the path written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path
