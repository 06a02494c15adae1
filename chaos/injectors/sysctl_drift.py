"""Kernel socket-buffer drift (seed §4.1: an ops script reset ``net.ipv4.tcp_rmem`` and TTFT P99
went from 210 to 890 ms).

Sets the four keys to drifted values — by default the distribution defaults the
incident found. ``net.ipv4.tcp_rmem``/``tcp_wmem`` are per network namespace: with
``netns=`` they drift inside the drill's namespace and the host keeps its values.
``net.core.rmem_max``/``wmem_max`` are global on Linux (read-only inside a
namespace), so they drift on the host only when ``allow_host=True``; otherwise they
are left alone and the result says so. The exact previous strings are saved
before anything changes and restored on rollback, which checks them. Only the
listed keys are ever touched.
"""

from __future__ import annotations

import re

from distserve.chaos import state
from distserve.chaos.sysutil import HostError, netns_exists, require_root, sysctl_get, sysctl_set

KIND = "sysctl"
KEYS = ("net.core.rmem_max", "net.core.wmem_max", "net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem")
GLOBAL_KEYS = ("net.core.rmem_max", "net.core.wmem_max")
DRIFTED = {  # what the incident's ops script left behind (kernel defaults)
    "net.core.rmem_max": "212992",
    "net.core.wmem_max": "212992",
    "net.ipv4.tcp_rmem": "4096 65536 4194304",
    "net.ipv4.tcp_wmem": "4096 16384 4194304",
}


def _key(netns: str | None) -> str:
    return netns or "host"


def inject(netns: str | None = None, values: dict | None = None, allow_host: bool = False, **_: object) -> dict:
    require_root("changing sysctls")
    values = {**DRIFTED, **(values or {})}
    unknown = set(values) - set(KEYS)
    if unknown:
        raise ValueError(f"values: only {', '.join(KEYS)} may drift, got {', '.join(sorted(unknown))}")
    plan: dict[str, str | None] = {}  # key -> namespace (None = host)
    skipped = []
    for k in values:
        where = None if (k in GLOBAL_KEYS or netns is None) else netns
        if where is None and not allow_host:
            skipped.append(k)
            continue
        plan[k] = where
    saved = state.load(KIND, _key(netns)) or {"netns": netns, "previous": {}}
    for k, where in plan.items():  # keep the oldest saved value when injected twice
        saved["previous"].setdefault(k, [where, sysctl_get(k, where)])
    state.save(KIND, _key(netns), saved)
    for k, where in plan.items():
        sysctl_set(k, " ".join(str(values[k]).split()), where)
    return {
        "mechanism": "sysctl -w " + ", ".join(f"{k} ({'netns ' + w if w else 'host'})" for k, w in plan.items()),
        "previous": {k: v for k, (_, v) in saved["previous"].items()},
        "drifted": {k: sysctl_get(k, w) for k, w in plan.items()},
        "skipped": {k: "global key: needs allow_host=True" for k in skipped},
    }


def rollback(netns: str | None = None, **_: object) -> dict:
    saved = state.load(KIND, _key(netns))
    if not saved:
        return {"rolled_back": False}
    restored, bad = {}, {}
    previous = saved.get("previous")
    if not isinstance(previous, dict):
        raise state.StateRefused("chaos state refused: sysctl state has no 'previous' table")
    for k, entry in previous.items():  # only the keys this injector manages, only values it could have read
        state.check_name("sysctl key", k, "|".join(re.escape(x) for x in KEYS))
        if not (isinstance(entry, list) and len(entry) == 2):
            raise state.StateRefused(f"chaos state refused: sysctl {k}: {entry!r} is not [netns, value]")
        if entry[0] is not None and entry[0] != netns:
            raise state.StateRefused(f"chaos state refused: sysctl {k} names namespace {entry[0]!r}, not {netns!r}")
        state.check_name(f"value of {k}", entry[1], r"[0-9]+([ \t][0-9]+)*")
    for k, (where, value) in previous.items():
        if where and not netns_exists(where):  # the namespace, and its settings, are gone already
            continue
        sysctl_set(k, value, where)
        restored[k] = sysctl_get(k, where)
        if restored[k] != value:
            bad[k] = restored[k]
    if bad:
        raise HostError(f"sysctl rollback left {bad}, expected {saved['previous']}")
    state.clear(KIND, _key(netns))
    return {"rolled_back": True, "restored": restored, "netns": netns}
