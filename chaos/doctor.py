"""`distserve doctor`: this host against the recommended baseline, and the command that fixes each drift.

Baseline (§4 of the source article, docs/FROM_THE_ARTICLE.md):
- KV-link socket buffers: ``net.core.rmem_max`` / ``wmem_max`` = 16777216, ``net.ipv4.tcp_rmem`` /
  ``tcp_wmem`` = "4096 262144 16777216" (checked on the host, or in ``--netns``);
- a memory cgroup controller to bound decode workers (and, given a router, each local decode
  worker actually under a memory limit);
- ``prefill.max_seq_len`` equal to the model's context length (given a router: the served model's
  ``max_model_len`` against its workers' model context);
- given a router: it answers, and a prefill + decode (or colocated) worker is registered and healthy.
Exit 0 when nothing drifted, 1 when something did, 2 on bad input.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass

BASELINE = {
    "net.core.rmem_max": "16777216",
    "net.core.wmem_max": "16777216",
    "net.ipv4.tcp_rmem": "4096 262144 16777216",
    "net.ipv4.tcp_wmem": "4096 262144 16777216",
}


@dataclass
class Finding:
    item: str
    ok: bool
    found: str
    want: str
    fix: str = ""


def check_sysctls(netns: str | None = None, keys: list[str] | None = None) -> list[Finding]:
    """``net.core.*`` are global: read inside a namespace they show (and are fixed on) the host."""
    from distserve.chaos.sysutil import HostError, sysctl_get

    out = []
    for key, want in BASELINE.items():
        if keys and key not in keys:
            continue
        prefix = f"ip netns exec {netns} " if netns and not key.startswith("net.core.") else ""
        try:
            found = sysctl_get(key, netns)
        except HostError as e:
            out.append(Finding(key, False, f"unreadable ({e})", want))
            continue
        fixed = _raised(found, want)  # never lowers a field that is already larger
        out.append(
            Finding(
                key,
                _at_least(found, want),
                found,
                f"at least {want}",
                f"{prefix}sysctl -w {key}=\"{fixed}\" && echo '{key} = {fixed}' >> "
                "/etc/sysctl.d/90-distserve.conf   # then restart the workers",
            )
        )
    return out


def _raised(found: str, want: str) -> str:
    """The baseline with each field kept at the host's value where that is larger."""
    try:
        f, w = [int(x) for x in found.split()], [int(x) for x in want.split()]
    except ValueError:
        return want
    if len(f) != len(w):
        return want
    return " ".join(str(max(a, b)) for a, b in zip(f, w, strict=True))


def _at_least(found: str, want: str) -> bool:
    """Every field at least the baseline's (larger buffers are not a drift)."""
    try:
        f, w = [int(x) for x in found.split()], [int(x) for x in want.split()]
    except ValueError:
        return False
    return len(f) == len(w) and all(a >= b for a, b in zip(f, w, strict=True))


def check_memory(decode_pids: list[int]) -> list[Finding]:
    from distserve.chaos.injectors.memory_limit import cgroup_flavour

    fl = cgroup_flavour()
    out = [
        Finding(
            "memory cgroup controller",
            fl is not None,
            fl[0] if fl else "none",
            "v2 or v1",
            "mount the cgroup v2 hierarchy with the memory controller enabled",
        )
    ]
    for pid in decode_pids:
        limit = _pid_memory_limit(pid)
        out.append(
            Finding(
                f"decode worker pid {pid} memory limit",
                limit is not None,
                "unlimited" if limit is None else f"{limit >> 20} MiB",
                "a memory cgroup limit",
                memory_limit_fix(pid, fl),
            )
        )
    return out


def memory_limit_fix(pid: int, flavour: tuple[str, str] | None) -> str:
    """The commands that put ``pid`` under a 70G memory limit on this host's cgroup hierarchy: v1 has a
    memory folder of its own and spells the limit memory.limit_in_bytes."""
    if flavour is not None and flavour[0] == "v1":
        d = f"{flavour[1]}/distserve-decode"
        limit = f"echo 70G > {d}/memory.limit_in_bytes"
    else:
        d = f"{flavour[1] if flavour else '/sys/fs/cgroup'}/distserve-decode"
        limit = f"echo 70G > {d}/memory.max"
    return (
        f"mkdir -p {d} && {limit} && echo {pid} > {d}/cgroup.procs  "
        "# or start it under: systemd-run -p MemoryMax=70G distserve worker --role decode ..."
    )


def _pid_memory_limit(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None
    for _, controllers, path in lines:
        for cand in (
            [f"/sys/fs/cgroup{path}/memory.max", f"/sys/fs/cgroup/unified{path}/memory.max"]
            if controllers == ""
            else [f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes"]
            if "memory" in controllers.split(",")
            else []
        ):
            try:
                with open(cand) as f:
                    text = f.read().strip()
            except OSError:
                continue
            if text != "max" and int(text) < (1 << 60):
                return int(text)
    return None


def check_max_seq_len(config_path: str | None, model: str | None = None) -> list[Finding]:
    from distserve.server.config import load_config
    from distserve.server.engine.loader import load_model_config, resolve_model_path

    cfg = load_config(config_path, {"model": model} if model else None)
    ctx = load_model_config(resolve_model_path(cfg.model)).max_position_embeddings
    where = config_path or "your config"
    return [
        Finding(
            "prefill.max_seq_len vs model context length",
            cfg.prefill.max_seq_len == ctx,
            str(cfg.prefill.max_seq_len),
            str(ctx),
            f"set `prefill: {{max_seq_len: {ctx}}}` in {where} (the model's max_position_embeddings)",
        )
    ]


def check_router(router: str, token: str | None) -> tuple[list[Finding], list[int]]:
    from distserve.chaos.probes import _get
    from distserve.chaos.workers import list_workers

    status, text = _get(f"{router}/health")
    if status == 0:  # nothing answered: say so, not "0"
        found = "connection refused" if "refused" in text.lower() else f"no answer ({text})"
        out = [
            Finding(
                "router /health",
                False,
                found,
                "200",
                f"nothing listens at {router}: start it (`distserve serve`, or `distserve router` and its "
                "workers) or fix --router",
            )
        ]
        return out, []
    out = [
        Finding(
            "router /health",
            status == 200,
            f"HTTP {status}",
            "HTTP 200",
            "start a prefill and a decode worker (in any order: a worker registers whenever the router "
            "answers) and look for 'Registered with router' in their logs; curl each worker's /health",
        )
    ]
    if not token:
        out.append(
            Finding(
                "workers' registration",
                False,
                "not checked",
                "admin token",
                "export DISTSERVE_ADMIN_TOKEN=... (the router's admin token) and run doctor again",
            )
        )
        return out, []
    try:
        ws = list_workers(router, token)
    except (OSError, ValueError) as e:
        out.append(
            Finding(
                "workers' registration",
                False,
                f"GET /v1/workers failed: {e}",
                "a worker list",
                "check the router URL and the admin token",
            )
        )
        return out, []
    roles = {w["role"] for w in ws if w["healthy"]}
    ok = {"prefill", "decode"} <= roles or "colocated" in roles
    out.append(
        Finding(
            "workers registered and healthy",
            ok,
            ", ".join(sorted(roles)) or "none",
            "prefill + decode, or colocated",
            f"distserve worker --role decode --router {router}  (and --role prefill); check that each "
            "worker can reach the router and the router can reach the worker's --host",
        )
    )
    for w in ws:
        if not w["healthy"]:
            out.append(
                Finding(
                    f"worker {w['worker_id']}",
                    False,
                    "unhealthy (heartbeats stopped)",
                    "healthy",
                    f"curl {w['url']}/health ; check the worker's log",
                )
            )
    out += _served_context(router, ws)
    local = [int(w["pid"]) for w in ws if w["role"] == "decode" and os.path.exists(f"/proc/{w['pid']}")]
    return out, local


def _served_context(router: str, ws: list[dict]) -> list[Finding]:
    """The served model's max_model_len (``/v1/models``) against that model's context (its workers'
    fingerprint), instead of the built-in model's."""
    from distserve.chaos.probes import _get

    status, text = _get(f"{router}/v1/models")
    ctx = next((w.get("fingerprint", {}).get("max_position_embeddings") for w in ws if w.get("fingerprint")), None)
    if status != 200 or not ctx:
        return []
    model = (json.loads(text).get("data") or [{}])[0]
    served = model.get("max_model_len")
    return [
        Finding(
            f"served max_model_len vs the context of {model.get('id')}",
            served == ctx,
            str(served),
            str(ctx),
            f"set `prefill: {{max_seq_len: {ctx}}}` in the served config (the model's max_position_embeddings)",
        )
    ]


def main(args) -> int:
    findings: list[Finding] = []
    only = set((args.only or "sysctl,memory,model,router").split(","))
    if only - {"sysctl", "memory", "model", "router"}:
        print(f"distserve: error: --only takes sysctl, memory, model, router; got {args.only!r}", file=sys.stderr)
        return 2
    try:
        if "sysctl" in only:
            keys = args.sysctl_keys.split(",") if args.sysctl_keys else None
            if keys and set(keys) - set(BASELINE):
                print(f"distserve: error: --sysctl-keys takes {', '.join(BASELINE)}", file=sys.stderr)
                return 2
            findings += check_sysctls(args.netns, keys)
        decode_pids: list[int] = []
        if args.router and "router" in only:
            rf, decode_pids = check_router(args.router.rstrip("/"), os.environ.get("DISTSERVE_ADMIN_TOKEN"))
            findings += rf
        if "memory" in only:
            findings += check_memory(decode_pids)
        if "model" in only and not (args.router and "router" in only and args.model is None):
            # with a router, its served model is checked (above); a config is checked against --model
            findings += check_max_seq_len(args.config, args.model)
    except (ValueError, FileNotFoundError) as e:
        print(f"distserve: error: {e}", file=sys.stderr)
        return 2
    drift = [f for f in findings if not f.ok]
    if args.json:
        print(json.dumps({"drift": len(drift), "findings": [asdict(f) for f in findings]}, indent=1))
    else:
        for f in findings:
            print(f"[{'ok' if f.ok else 'DRIFT':>5}] {f.item}: {f.found}" + ("" if f.ok else f" (want {f.want})"))
            if not f.ok and f.fix:
                print(f"        fix: {f.fix}")
        print(
            f"doctor: {len(drift)} drifted of {len(findings)} checked"
            if drift
            else f"doctor: all {len(findings)} checks match the baseline"
        )
    return 1 if drift else 0
