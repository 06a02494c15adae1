"""Where injectors keep what their rollback needs.

An injector's ``rollback(**kw)`` must work with the same keyword arguments as its
``inject(**kw)`` — also from another process (a Chaos Toolkit rollback, or a
second `distserve chaos rollback` after a crash). So ``inject`` writes what it
changed (previous sysctl values, the PID it stopped, the cgroup it made) to a
small JSON file named by the injector and a key, written atomically; ``rollback``
reads it, undoes, and deletes it. A missing file means there is nothing to undo.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from distbench.atomic import atomic_write

ENV = "DISTSERVE_CHAOS_STATE_DIR"


def state_dir() -> Path:
    d = Path(os.environ.get(ENV) or "/tmp/distserve-chaos-state")
    d.mkdir(parents=True, exist_ok=True)
    return d


def _path(kind: str, key: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{kind}--{key}")
    return state_dir() / f"{safe}.json"


def save(kind: str, key: str, data: dict) -> Path:
    return atomic_write(_path(kind, key), json.dumps(data, indent=1))


def load(kind: str, key: str) -> dict | None:
    p = _path(kind, key)
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        return None


def clear(kind: str, key: str) -> None:
    _path(kind, key).unlink(missing_ok=True)


def pending() -> list[Path]:
    """State files of injections not rolled back yet (what `distserve chaos rollback --all` undoes)."""
    return sorted(state_dir().glob("*.json"))
