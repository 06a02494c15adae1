"""KV-link degradation between a decode worker in its own network namespace and the prefill side.

Faults (``fault=``) and the mechanism each uses — the result names it, so the
journal says what was really done on this kernel:

- ``bandwidth`` (``rate``, e.g. "8mbit"): ``tc tbf`` on the root side of the veth (the KV direction).
- ``latency`` (``latency_ms``, ``jitter_ms``): ``tc netem`` where the kernel has it, else the
  userspace proxy's latency toxic.
- ``loss`` (``percent``): ``tc netem loss`` where available, else nftables ``numgen random`` drops
  inside the namespace on packets from the prefill KV port(s).
- ``partition``: nftables drops inside the namespace, KV port(s) only (``scope="kv"``) or every
  packet to and from the prefill side (``scope="all"``: heartbeats stop too).
- ``slicer``, ``reset_peer``, ``slow_close``, ``timeout``, ``limit_data``, ``jitter``: the proxy
  (`chaos.proxy`), its toxic taking the other keyword arguments (toxiproxy's names).

Proxy faults redirect the namespace's new connections to the prefill KV port to the proxy with
an nftables DNAT rule, and reset established ones (``ss -K``) so pooled KV connections reconnect
through it. ``rollback`` removes the qdisc, the nftables tables and the proxy (by PID).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any
from urllib.parse import urlparse

from distserve.chaos import state
from distserve.chaos.proxy import TOXICS, validate_toxic
from distserve.chaos.sysutil import (
    HostError,
    kernel_has_netem,
    listening_ports,
    netns_exists,
    require_root,
    run,
)
from distserve.chaos.workers import list_workers

KIND = "kv_link"
FILTER_TABLE = "dschaos_filter"
NAT_TABLE = "dschaos_nat"
FAULTS = (
    "bandwidth",
    "latency",
    "loss",
    "partition",
    "jitter",
    *[t for t in TOXICS if t not in ("latency", "bandwidth")],
)


def prefill_kv_ports(router_url: str, token: str | None = None) -> list[int]:
    """The KV staging ports of every prefill worker: what its PID listens on besides its HTTP port."""
    ports: set[int] = set()
    for w in list_workers(router_url, token):
        if w["role"] == "prefill":
            http_port = urlparse(w["url"]).port
            ports |= listening_ports(int(w["pid"])) - {http_port}
    if not ports:
        raise HostError("found no prefill worker KV port (is a prefill worker registered, on this host?)")
    return sorted(ports)


def _link(netns: str) -> dict:
    info = state.load("netns", netns)
    if not info or not netns_exists(netns):
        raise HostError(f"namespace {netns} was not made by the netns injector (or is gone)")
    return info


def _nft_table(netns: str, family: str, table: str, chains: dict[str, tuple[str, list[str]]]) -> None:
    """One table of chains {name: (hook declaration, rules)}, one rule per line (nft's parser wants
    a newline, not a semicolon, after some statements such as dnat)."""
    lines = [f"table {family} {table} {{"]
    for name, (decl, rules) in chains.items():
        lines += [f"  chain {name} {{", f"    {decl};", *[f"    {r}" for r in rules], "  }"]
    lines.append("}")
    run(["nft", "-f", "-"], netns=netns, input="\n".join(lines) + "\n")


def _reset_kv_connections(netns: str, host_ip: str, ports: list[int]) -> None:
    for p in ports:
        run(["ss", "-K", "dst", host_ip, "dport", "=", str(p)], netns=netns, check=False)


def _start_proxy(host_ip: str, ports: list[int], toxic: dict) -> list[dict]:
    procs = []
    for p in ports:
        ready = os.path.join(tempfile.mkdtemp(prefix="dschaos-proxy-"), "ready.json")
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "distserve.chaos.proxy",
                "--listen",
                f"{host_ip}:0",
                "--upstream",
                f"{host_ip}:{p}",
                "--toxic",
                json.dumps(toxic),
                "--ready-file",
                ready,
            ],
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while not os.path.exists(ready):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise HostError(f"the KV proxy for port {p} did not start")
            time.sleep(0.05)
        with open(ready) as f:
            procs.append({"pid": proc.pid, "upstream_port": p, "port": json.load(f)["port"]})
    return procs


def inject(
    netns: str,
    fault: str,
    router_url: str | None = None,
    token: str | None = None,
    kv_ports: list[int] | None = None,
    mechanism: str = "auto",
    **kw: Any,
) -> dict:
    """``mechanism``: auto (netem where the kernel has it), or force ``netem``/``tbf``/``nft``/``proxy``."""
    require_root("degrading the KV link")
    if fault not in FAULTS:
        raise ValueError(f"fault {fault!r} is unknown; known: {', '.join(FAULTS)}")
    link = _link(netns)
    host_if, host_ip = link["host_if"], link["host_ip"]
    ports = list(kv_ports) if kv_ports else (prefill_kv_ports(router_url, token) if router_url else [])
    if fault != "bandwidth" and not ports and not (fault == "partition" and kw.get("scope") == "all"):
        raise ValueError("router_url or kv_ports: the prefill KV port(s) are needed for this fault")
    netem = mechanism == "netem" or (mechanism == "auto" and fault in ("latency", "loss") and kernel_has_netem())
    saved = {
        "netns": netns,
        "host_if": host_if,
        "qdisc": False,
        "tables": [],
        "proxies": [],
        "ports": ports,
        "host_ip": host_ip,
    }
    state.save(KIND, netns, saved)
    out: dict = {"fault": fault, "kv_ports": ports}
    if fault == "bandwidth":
        rate = str(kw.get("rate", "8mbit"))
        saved["qdisc"] = True  # recorded before the change: a kill midway still rolls it back
        state.save(KIND, netns, saved)
        run(
            [
                "tc",
                "qdisc",
                "replace",
                "dev",
                host_if,
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                str(kw.get("burst", "32kbit")),
                "latency",
                str(kw.get("queue_latency", "400ms")),
            ]
        )
        out.update(mechanism="tc tbf", rate=rate)
    elif netem:
        args = (
            ["delay", f"{kw.get('latency_ms', 50)}ms", f"{kw.get('jitter_ms', 0)}ms"]
            if fault == "latency"
            else ["loss", f"{kw.get('percent', 10)}%"]
        )
        saved["qdisc"] = True
        state.save(KIND, netns, saved)
        run(["tc", "qdisc", "replace", "dev", host_if, "root", "netem", *args])
        out.update(mechanism="tc netem " + " ".join(args))
    elif fault == "loss":
        pct = int(kw.get("percent", 10))
        if not 0 < pct <= 100:
            raise ValueError(f"percent must be in 1..100, got {pct}")
        sports = ", ".join(map(str, ports))
        saved["tables"].append(["inet", FILTER_TABLE])
        state.save(KIND, netns, saved)
        _nft_table(
            netns,
            "inet",
            FILTER_TABLE,
            {
                "in": (
                    "type filter hook input priority 0",
                    [f"ip saddr {host_ip} tcp sport {{ {sports} }} numgen random mod 100 < {pct} drop"],
                )
            },
        )
        out.update(mechanism=f"nftables numgen random drop {pct}% (no netem)", percent=pct)
    elif fault == "partition":
        scope = kw.get("scope", "kv")
        if scope == "all":
            rules_in, rules_out = f"ip saddr {host_ip} drop", f"ip daddr {host_ip} drop"
        else:
            ps = ", ".join(map(str, ports))
            rules_in = f"ip saddr {host_ip} tcp sport {{ {ps} }} drop"
            rules_out = f"ip daddr {host_ip} tcp dport {{ {ps} }} drop"
        saved["tables"].append(["inet", FILTER_TABLE])
        state.save(KIND, netns, saved)
        _nft_table(
            netns,
            "inet",
            FILTER_TABLE,
            {
                "in": ("type filter hook input priority 0", [rules_in]),
                "out": ("type filter hook output priority 0", [rules_out]),
            },
        )
        out.update(mechanism="nftables drop", scope=scope)
    else:  # the userspace proxy
        toxic_type = "latency" if fault in ("latency", "jitter") else fault
        names = {"latency_ms": "latency", "jitter_ms": "jitter"}  # this module's names -> toxiproxy's
        toxic = validate_toxic(
            {"type": toxic_type, **{names.get(k, k): v for k, v in kw.items() if k not in ("scope", "rate", "percent")}}
        )
        procs = _start_proxy(host_ip, ports, toxic)
        saved["proxies"] = procs
        state.save(KIND, netns, saved)
        rules = [f"ip daddr {host_ip} tcp dport {p['upstream_port']} dnat to {host_ip}:{p['port']}" for p in procs]
        saved["tables"].append(["ip", NAT_TABLE])
        state.save(KIND, netns, saved)
        _nft_table(netns, "ip", NAT_TABLE, {"out": ("type nat hook output priority -100", rules)})
        out.update(
            mechanism=f"userspace proxy (chaos.proxy) toxic {toxic}" + ("" if mechanism == "proxy" else " (no netem)"),
            proxies=procs,
        )
    state.save(KIND, netns, saved)
    if fault != "bandwidth":  # pooled KV connections must take the new path
        _reset_kv_connections(netns, host_ip, ports)
    return out


def _is_proxy(pid: object) -> bool:
    """Whether ``pid`` is a chaos proxy (``python -m distserve.chaos.proxy``): the only processes rollback stops."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 1:
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"distserve.chaos.proxy" in f.read()
    except OSError:
        return False


def rollback(netns: str, **_: object) -> dict:
    saved = state.load(KIND, netns)
    if not saved:
        return {"rolled_back": False}
    host_if = state.check_name("veth link", saved.get("host_if"), r"dsc[0-9a-f]{6}h")
    tables = [tuple(t) for t in saved.get("tables") or []]
    for t in tables:  # only the tables this injector creates
        if t not in (("inet", FILTER_TABLE), ("ip", NAT_TABLE)):
            raise state.StateRefused(f"chaos state refused: nft table {t!r} is not one kv_link makes")
    restored = []
    if saved.get("qdisc") and os.path.exists(f"/sys/class/net/{host_if}"):
        run(["tc", "qdisc", "del", "dev", host_if, "root"], check=False)
        restored.append(f"qdisc on {host_if}")
    if netns_exists(netns):
        for family, table in tables:
            run(["nft", "delete", "table", family, table], netns=netns, check=False)
            restored.append(f"nft table {family} {table} in {netns}")
    for p in saved.get("proxies") or []:
        if not isinstance(p, dict) or not _is_proxy(p.get("pid")):
            continue  # gone, or not a proxy of ours: never signal it
        restored.append(f"proxy pid {p['pid']}")
        try:
            os.kill(p["pid"], signal.SIGTERM)
        except ProcessLookupError:
            continue
        for _attempt in range(50):
            try:
                if os.waitpid(p["pid"], os.WNOHANG)[0]:
                    break
            except ChildProcessError:  # not our child: poll for its exit
                try:
                    os.kill(p["pid"], 0)
                except ProcessLookupError:
                    break
            time.sleep(0.05)
        else:
            try:
                os.kill(p["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
    if netns_exists(netns) and saved.get("ports"):
        _reset_kv_connections(netns, saved["host_ip"], saved["ports"])
    state.clear(KIND, netns)
    return {"rolled_back": True, "restored": restored}
