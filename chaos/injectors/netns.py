"""A second "host" on one machine: a network namespace joined to the root namespace by a veth pair.

A drill runs a decode worker inside it, so its KV pulls cross a real link
(`<host_ip>` on the root side, `<ns_ip>` inside) that the link injectors can cap,
drop, partition or proxy — and kernel settings that are per namespace
(`net.ipv4.tcp_rmem`, and on recent kernels `net.core.rmem_max`) can drift there
without touching the host. ``rollback`` deletes the namespace, which removes the
veth pair and every qdisc and nftables table inside it.
"""

from __future__ import annotations

import ipaddress
import os
import secrets

from distserve.chaos import state
from distserve.chaos.sysutil import HostError, netns_exists, require_root, run

KIND = "netns"
NAME_PATTERN = r"[A-Za-z0-9_.-]{1,64}"
LINK_PATTERN = r"dsc[0-9a-f]{6}[hn]"  # the veth pair's names, as inject() gives them


def _free_subnet() -> ipaddress.IPv4Network:
    used = run(["ip", "-4", "-o", "addr"])
    for _ in range(64):
        net = ipaddress.IPv4Network(f"10.213.{secrets.randbelow(250) + 1}.{4 * secrets.randbelow(63)}/30")
        if f" {net[1]}/" not in used and f" {net[2]}/" not in used:
            return net
    raise HostError("no free 10.213.x.y/30 subnet for the drill's veth pair")


def inject(name: str | None = None, **_: object) -> dict:
    """Create namespace ``name`` (default: a fresh dschaos-xxxxxx) with a veth pair and addresses."""
    require_root("creating a network namespace")
    name = name or f"dschaos-{secrets.token_hex(3)}"
    if netns_exists(name):
        raise HostError(f"network namespace {name} already exists")
    tag = secrets.token_hex(3)
    host_if, ns_if = f"dsc{tag}h", f"dsc{tag}n"
    net = _free_subnet()
    host_ip, ns_ip = str(net[1]), str(net[2])
    info = {
        "netns": name,
        "host_if": host_if,
        "ns_if": ns_if,
        "host_ip": host_ip,
        "ns_ip": ns_ip,
        "prefix": net.prefixlen,
        "mechanism": "ip netns + veth",
    }
    state.save(KIND, name, info)  # before creating anything: a crash midway still rolls back
    try:
        run(["ip", "netns", "add", name])
        run(["ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if])
        run(["ip", "link", "set", ns_if, "netns", name])
        run(["ip", "addr", "add", f"{host_ip}/{net.prefixlen}", "dev", host_if])
        run(["ip", "link", "set", host_if, "up"])
        run(["ip", "addr", "add", f"{ns_ip}/{net.prefixlen}", "dev", ns_if], netns=name)
        run(["ip", "link", "set", ns_if, "up"], netns=name)
        run(["ip", "link", "set", "lo", "up"], netns=name)
    except HostError:
        rollback(netns=name)
        raise
    return info


def rollback(netns: str | None = None, name: str | None = None, **_: object) -> dict:
    name = netns or name
    if not name:
        return {"rolled_back": False}
    state.check_name("network namespace", name, NAME_PATTERN)
    info = state.load(KIND, name) or {}
    host_if = info.get("host_if")
    if host_if is not None:
        state.check_name("veth link", host_if, LINK_PATTERN)  # only a link this injector named
    removed = []
    if netns_exists(name):
        run(["ip", "netns", "del", name], check=False)
        removed.append(f"netns {name}")
    if host_if and os.path.exists(f"/sys/class/net/{host_if}"):
        run(["ip", "link", "del", host_if], check=False)
        removed.append(f"link {host_if}")
    state.clear(KIND, name)
    return {"rolled_back": True, "netns": name, "removed": removed}
