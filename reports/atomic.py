"""Atomic file writes: a temporary file in the same folder, then ``os.replace``."""

from __future__ import annotations

import os
from pathlib import Path


def atomic_write(path: Path, data: bytes | str) -> None:
    path = Path(path)
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
