"""Kernel socket-buffer drift (seed §4.1: an ops script reset ``net.ipv4.tcp_rmem`` and TTFT P99
went from 210 to 890 ms).

Sets the four keys to drifted values — by default the distribution defaults the
incident found — inside a network namespace (``netns=``: the drill's second
host; the host keeps its values) or, only with ``allow_host=True``, on the host.
The exact previous strings are saved first and restored on rollback. Only the
listed keys are touched.
"""

from __future__ import annotations

from chaos import state
from chaos.sysutil import HostError, netns_exists, require_root, sysctl_get, sysctl_set

KIND = "sysctl"
KEYS = ("net.core.rmem_max", "net.core.wmem_max", "net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem")
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
    if netns is None and not allow_host:
        raise HostError("sysctl drift on the host needs allow_host=True; drills drift inside their namespace")
    values = {**DRIFTED, **(values or {})}
    unknown = set(values) - set(KEYS)
    if unknown:
        raise ValueError(f"values: only {', '.join(KEYS)} may drift, got {', '.join(sorted(unknown))}")
    saved = state.load(KIND, _key(netns)) or {"netns": netns, "previous": {}}
    for k in values:  # keep the oldest saved value when injected twice
        saved["previous"].setdefault(k, sysctl_get(k, netns))
    state.save(KIND, _key(netns), saved)
    for k, v in values.items():
        sysctl_set(k, " ".join(str(v).split()), netns)
    return {"mechanism": "sysctl -w" + (f" in netns {netns}" if netns else " on the host"),
            "previous": saved["previous"], "drifted": {k: sysctl_get(k, netns) for k in values}}


def rollback(netns: str | None = None, **_: object) -> dict:
    saved = state.load(KIND, _key(netns))
    if not saved:
        return {"rolled_back": False}
    if netns and not netns_exists(netns):  # the namespace, and its settings, are gone already
        state.clear(KIND, _key(netns))
        return {"rolled_back": True, "note": f"namespace {netns} no longer exists"}
    for k, v in saved["previous"].items():
        sysctl_set(k, v, netns)
    restored = {k: sysctl_get(k, netns) for k in saved["previous"]}
    bad = {k: v for k, v in restored.items() if v != saved["previous"][k]}
    if bad:
        raise HostError(f"sysctl rollback left {bad}, expected {saved['previous']}")
    state.clear(KIND, _key(netns))
    return {"rolled_back": True, "restored": restored}
