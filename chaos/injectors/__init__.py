"""Fault injectors: one module per fault, each a plain ``inject(**kw)`` / ``rollback(**kw)`` pair.

Every pair acts on processes, network namespaces, qdiscs, nftables, cgroups or
sysctls — never on server internals — so it runs alone (`distserve chaos inject
NAME key=value ...`), inside a drill, or as a Chaos Toolkit python provider
(``{"type": "python", "module": "distserve.chaos.injectors.kill", "func": "inject"}``).
``inject`` returns a JSON-able dict (what it did, and by which mechanism) that the
drill journal records; ``rollback`` takes the same keyword arguments and is
idempotent (state in `chaos.state`).
"""

from __future__ import annotations

import importlib
from types import ModuleType

INJECTORS = (
    "kill",
    "pause",
    "disconnect_storm",
    "sysctl_drift",
    "netns",
    "kv_link",
    "memory_limit",
    "prefill_exhaustion",
    "latency",
)


def get(name: str) -> ModuleType:
    if name not in INJECTORS:
        raise ValueError(f"injector {name!r} is unknown; known: {', '.join(INJECTORS)}")
    return importlib.import_module(f"distserve.chaos.injectors.{name}")
