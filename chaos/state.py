"""Where injectors keep what their rollback needs — in a folder only the running user controls.

An injector's ``rollback(**kw)`` must work with the same keyword arguments as its
``inject(**kw)`` — also from another process (a Chaos Toolkit rollback, or
``distserve chaos rollback --all`` after a drill was killed). So ``inject`` writes what it is about
to change (previous sysctl values, the PID it will stop, the cgroup it will make) to a small JSON
file named by the injector and a key, atomically, *before* it changes anything; ``rollback`` reads
it, undoes, and deletes it. A missing file means there is nothing to undo.

A rollback runs as root and acts on what the file says, so the file is trusted only when nobody
else could have written it:

- the folder is private: ``$DISTSERVE_CHAOS_STATE_DIR``, else ``$XDG_RUNTIME_DIR/distserve/chaos``,
  else ``~/.cache/distserve/chaos``; created ``0700``; refused when another user owns it (a fixed
  path under ``/tmp`` let any local user plant state that root's rollback then obeyed);
- a state file must be a regular file (not a link) owned by the running user and not writable by
  group or others, else it is refused (:class:`StateRefused`) and nothing is done;
- each injector's rollback acts only on objects of its own making (an allow-list: the sysctl keys
  it manages, links and cgroups by the names it gives them), whatever the file says.

Each file records its injector kind and key, so ``rollback --all`` can undo every pending one
(:func:`pending` walks the folder, drills' sub-folders included).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from distserve.distbench.atomic import atomic_write
from distserve.server.private_files import UnsafePath, check_private_file, private_dir

ENV = "DISTSERVE_CHAOS_STATE_DIR"


class StateRefused(ValueError):
    """A state file or folder another user could have written: not acted on."""


def state_root() -> Path:
    """The private folder of this user's chaos state (without ``$DISTSERVE_CHAOS_STATE_DIR``)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "distserve" if runtime else Path.home() / ".cache" / "distserve"
    try:
        return private_dir(base / "chaos")
    except UnsafePath as e:
        raise StateRefused(f"chaos state folder refused: {e}") from None


def state_dir() -> Path:
    override = os.environ.get(ENV)
    if not override:
        return state_root()
    try:
        return private_dir(override)
    except UnsafePath as e:
        raise StateRefused(f"chaos state folder refused ({ENV}): {e}") from None


def _path(kind: str, key: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{kind}--{key}")
    return state_dir() / f"{safe}.json"


def save(kind: str, key: str, data: dict) -> Path:
    p = atomic_write(_path(kind, key), json.dumps({**data, "_kind": kind, "_key": key}, indent=1))
    os.chmod(p, 0o600)
    return p


def read(p: Path) -> dict:
    """A state file's content after the ownership checks; :class:`StateRefused` if it fails them."""
    try:
        check_private_file(p)
    except UnsafePath as e:
        raise StateRefused(f"chaos state refused: {e}") from None
    try:
        data = json.loads(p.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise StateRefused(f"chaos state refused: {p} is not a JSON object: {e}") from None
    if not isinstance(data, dict):
        raise StateRefused(f"chaos state refused: {p} is not a JSON object")
    return data


def load(kind: str, key: str) -> dict | None:
    p = _path(kind, key)
    try:
        return read(p)
    except FileNotFoundError:
        return None


def clear(kind: str, key: str) -> None:
    _path(kind, key).unlink(missing_ok=True)


def pending(root: Path | None = None) -> list[Path]:
    """State files of injections not rolled back yet (what `distserve chaos rollback --all` undoes),
    in this folder and its sub-folders (a drill keeps its state in one of its own)."""
    return sorted((root or state_dir()).rglob("*.json"))


def check_name(what: str, value: object, pattern: str) -> str:
    """``value`` if it is a string matching ``pattern`` (an injector's own naming), else StateRefused."""
    if not isinstance(value, str) or not re.fullmatch(pattern, value):
        raise StateRefused(f"chaos state refused: {what} {value!r} is not one this injector makes")
    return value
