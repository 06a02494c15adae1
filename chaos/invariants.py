"""The invariants every drill asserts after its faults, plus the drill's own objective.

- ``requests``: every distbench request completed (tokens) or failed with a clear error, within its
  timeout — none lost, none hung (a load that outlived its timeout is a failure).
- ``kv_blocks_zero``: KV blocks used back to 0 and no staged KV on every worker (within ``within_s``).
  A decode stale slot holds blocks, so this also bounds stale slots (not exported separately).
- ``breaker_closed``: the router's breaker back to CLOSED, when the router exposes one.
- ``objective``: the drill's own claims (success ratio, TTFT P99, live roles, action fields, probes).
"""

from __future__ import annotations

import time

from distserve.chaos.probes import _get, metric_value, run_probe
from distserve.chaos.workers import list_workers


def summarize(records: list[dict], timeout_s: float) -> dict:
    ok = [r for r in records if r.get("error") is None and (r.get("output_tokens") or 0) > 0]
    failed = [r for r in records if r.get("error")]
    lost = [r for r in records if r not in ok and r not in failed]
    late = [r for r in records if (r.get("e2e") or 0) > timeout_s]
    ttfts = sorted(r["ttft"] * 1000 for r in ok if r.get("ttft") is not None)

    def pct(p: float) -> float | None:
        return round(ttfts[min(len(ttfts) - 1, int(p / 100 * len(ttfts)))], 1) if ttfts else None

    errors: dict[str, int] = {}
    for r in failed:
        key = str(r["error"])[:120]
        errors[key] = errors.get(key, 0) + 1
    return {
        "total": len(records),
        "ok": len(ok),
        "failed": len(failed),
        "lost": len(lost),
        "late": len(late),
        "ttft_p50_ms": pct(50),
        "ttft_p99_ms": pct(99),
        "e2e_max_s": round(max((r.get("e2e") or 0) for r in records), 3) if records else None,
        "errors": errors,
    }


def _check(name: str, ok: bool | None, detail) -> dict:
    return {"name": name, "status": "skipped" if ok is None else ("passed" if ok else "failed"), "detail": detail}


def requests_invariant(load: dict) -> dict:
    if not load:
        return _check("requests: none lost or hung", None, "no load in this drill")
    if load.get("hung"):
        return _check(
            "requests: none lost or hung", False, f"load still running after {load['timeout_s']} s: requests hung"
        )
    s = load.get("summary")
    if s is None:
        return _check("requests: none lost or hung", False, load.get("error", "no result file"))
    unclear = [e for e in s["errors"] if not e.strip() or e.strip().lower() in ("error", "none")]
    ok = s["lost"] == 0 and s["late"] == 0 and not unclear and s["total"] > 0
    return _check(
        "requests: none lost or hung",
        ok,
        f"{s['total']} requests: {s['ok']} completed, {s['failed']} failed with an error, "
        f"{s['lost']} lost, {s['late']} past the timeout" + (f", unclear errors {unclear}" if unclear else ""),
    )


KV_SETTLE_S = 1.0  # "back to 0" must still hold this long after (a few heartbeats): not a moment between phases


def kv_blocks_invariant(router: str, token: str, within_s: float) -> dict:
    """Every live worker at 0 KV blocks used and 0 staged, with no request of the router's in flight there, and
    still so ``KV_SETTLE_S`` later. Without the in-flight condition a storm's requests still waiting for their KV
    pull read as 0 blocks for a moment, before the pulls failed and a leaky worker kept their blocks (the planted
    defect passed this check now and then, its leak seen only by the steady state after)."""
    deadline = time.monotonic() + within_s
    settled_at: float | None = None
    while True:
        try:
            ws = [w for w in list_workers(router, token) if w["healthy"]]  # a dead process holds no blocks
            busy: dict[str, object] = {
                w["worker_id"]: (w["kv_blocks_used"], w["num_staged_kv"], w.get("inflight", 0))
                for w in ws
                if w["kv_blocks_used"] or w["num_staged_kv"] or w.get("inflight", 0)
            }
        except (OSError, ValueError) as e:
            busy, ws = {"router": str(e)}, []
        now = time.monotonic()
        if busy:
            settled_at = None
        elif settled_at is None:
            settled_at = now
        if (settled_at is not None and now - settled_at >= KV_SETTLE_S) or now >= deadline:
            break
        time.sleep(0.25)
    ok = not busy and settled_at is not None
    return _check(
        "kv blocks used back to 0 on every worker",
        ok,
        f"{len(ws)} live workers, all at 0 blocks used / 0 staged / 0 in flight"
        if ok
        else f"after {within_s} s still (blocks used, staged, in flight): {busy}",
    )


def breaker_invariant(router: str, within_s: float) -> dict:
    """``distserve_breaker_state`` (0 closed, 1 open, 2 half-open) back to 0, when the router has a breaker."""
    deadline = time.monotonic() + within_s
    while True:
        status, text = _get(f"{router}/metrics")
        value = metric_value(text, "distserve_breaker_state") if status == 200 else None
        enabled = metric_value(text, "distserve_breaker_enabled") if status == 200 else None
        if value is None or not enabled:
            return _check("breaker back to CLOSED", None, "the router exposes no enabled breaker")
        if value == 0 or time.monotonic() >= deadline:
            return _check("breaker back to CLOSED", value == 0, f"distserve_breaker_state = {value} (0 = closed)")
        time.sleep(0.5)


def state_invariant(state_dir, keep: tuple[str, ...] = ()) -> dict:
    """Every injection was rolled back: no injector state file is left (``keep``: the target's own, such as
    the namespace it runs a worker in, removed when the target stops)."""
    left = sorted(p.name for p in state_dir.glob("*.json") if p.name not in keep) if state_dir.exists() else []
    return _check("rollback complete: no injector state left", not left, f"left: {left}" if left else "none left")


def objective_invariants(obj: dict, load: dict, run: list[dict], router: str, token: str, alive: dict) -> list[dict]:
    out = []
    s = (load or {}).get("summary") or {}
    if "min_success_ratio" in obj:
        ratio = s["ok"] / s["total"] if s.get("total") else 0.0
        out.append(
            _check(
                f"objective: success ratio >= {obj['min_success_ratio']}",
                ratio >= obj["min_success_ratio"],
                f"{ratio:.3f} ({s.get('ok')}/{s.get('total')})",
            )
        )
    if "max_ttft_p99_ms" in obj:
        p99 = s.get("ttft_p99_ms")
        out.append(
            _check(
                f"objective: TTFT P99 <= {obj['max_ttft_p99_ms']} ms",
                p99 is not None and p99 <= obj["max_ttft_p99_ms"],
                f"TTFT P99 {p99} ms",
            )
        )
    for role in obj.get("roles_alive", []):
        pids = alive.get(role, [])
        from distserve.chaos.sysutil import pid_alive

        dead = [p for p in pids if not pid_alive(p)]
        out.append(
            _check(
                f"objective: every {role} worker process lives", bool(pids) and not dead, f"pids {pids}, dead {dead}"
            )
        )
    for a in obj.get("action_fields", []):
        entry = next((r for r in run if r["name"] == a["action"]), None)
        value = (entry or {}).get("output", {}) or {}
        for part in a["field"].split("."):
            value = value.get(part) if isinstance(value, dict) else None
        ok = value is not None and a.get("min", float("-inf")) <= value <= a.get("max", float("inf"))
        out.append(
            _check(
                f"objective: {a['action']}.{a['field']} in [{a.get('min', '-inf')}, {a.get('max', 'inf')}]",
                ok,
                f"value {value}",
            )
        )
    for p in obj.get("probes", []):
        r = run_probe(p, router, token)
        out.append(_check(f"objective: {r['name']}", r["ok"], f"value {r['value']!r}, tolerance {r['tolerance']!r}"))
    return out
