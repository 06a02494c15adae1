"""``distserve chaos rollback --all``: undo every injection whose state is still recorded.

A drill killed with SIGKILL runs no ``finally``: whatever it injected stays (host sysctls, the drill's
namespace and veth pair, qdiscs, nftables tables, a memory cgroup, stopped processes). Each injector
recorded its state *before* acting (``chaos/state.py``), so this walks the user's private state folder
(drills' sub-folders included, and ``$DISTSERVE_CHAOS_STATE_DIR`` when set), and calls each injector's
own rollback in dependency order: processes first, then what lives on the drill's link, then sysctls,
and the namespace last (deleting it removes what is inside it). It reports exactly what it restored,
what it refused (state another user could have written) and what failed; ``ok`` is False — and the
command exits 1 — when something recorded was not restored.
"""

from __future__ import annotations

import os
from pathlib import Path

from distserve.chaos import injectors, state

# state kind -> (injector module, the rollback keyword that takes the state's key), in rollback order
KINDS: dict[str, tuple[str, str]] = {
    "pause": ("pause", "key"),
    "latency": ("latency", "key"),
    "memory_limit": ("memory_limit", "key"),
    "kv_link": ("kv_link", "netns"),
    "sysctl": ("sysctl_drift", "netns"),
    "netns": ("netns", "netns"),
}


def _roots() -> list[Path]:
    roots = [state.state_root()]
    if os.environ.get(state.ENV):
        roots.append(state.state_dir())
    return roots


def _found() -> list[Path]:
    seen: dict[str, Path] = {}
    for root in _roots():
        for p in state.pending(root):
            seen.setdefault(str(p.resolve()), p)
    return list(seen.values())


def rollback_all() -> dict:
    todo: list[tuple[int, Path, str, str]] = []
    refused, failed, restored = [], [], []
    for p in _found():
        try:
            data = state.read(p)
        except state.StateRefused as e:
            refused.append({"file": str(p), "error": str(e)})
            continue
        kind, key = data.get("_kind"), data.get("_key")
        if not isinstance(kind, str) or not isinstance(key, str):  # an older file: kind--key.json
            kind, _, key = p.stem.partition("--")
        if kind not in KINDS:
            failed.append({"file": str(p), "error": f"unknown injector state kind {kind!r}"})
            continue
        todo.append((list(KINDS).index(kind), p, kind, key))
    old_env = os.environ.get(state.ENV)
    try:
        for _, p, kind, key in sorted(todo):
            module, arg = KINDS[kind]
            value: str | None = None if (kind == "sysctl" and key == "host") else key
            os.environ[state.ENV] = str(p.parent)  # the injector reads its state where it was written
            try:
                out = injectors.get(module).rollback(**{arg: value})
            except Exception as e:  # noqa: BLE001 - one failed rollback must not stop the others
                failed.append({"file": str(p), "injector": module, "key": key, "error": f"{type(e).__name__}: {e}"})
                continue
            if not out.get("rolled_back") or p.exists():
                failed.append({"file": str(p), "injector": module, "key": key, "error": f"not rolled back: {out}"})
            else:
                restored.append({"injector": module, "key": key, "result": out})
    finally:
        if old_env is None:
            os.environ.pop(state.ENV, None)
        else:
            os.environ[state.ENV] = old_env
    for root in _roots():  # drills' emptied sub-folders
        for d in sorted((x for x in root.rglob("*") if x.is_dir()), reverse=True):
            try:
                d.rmdir()
            except OSError:
                pass
    return {"ok": not failed and not refused, "restored": restored, "refused": refused, "failed": failed}
