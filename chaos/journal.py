"""A drill's journal (Chaos Toolkit's shape: status, steady states, run, rollbacks) and its report.

Status is one of ``completed`` (every invariant held), ``failed`` (the
hypothesis deviated or an invariant failed), ``aborted`` (the drill itself could
not run: set-up, a tool, an injector) or ``interrupted`` (Ctrl-C / SIGTERM).
Both files are written atomically, so a killed drill never leaves half a journal.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from distserve.distbench.atomic import atomic_write

# "seed" in drill and gate texts: one sentence wherever it is named
SEED_NOTE = (
    '"seed §N" is section N of the source article this project was built from (a Chinese write-up of '
    "DistServe-style prefill/decode disaggregation: its config, deployment steps and troubleshooting table); "
    "docs/FROM_THE_ARTICLE.md maps each of its commands and keys onto this project"
)

STATUSES = ("completed", "failed", "aborted", "interrupted")


@dataclass
class Journal:
    drill: str
    title: str
    incident: str = ""
    status: str = "aborted"
    start: float = field(default_factory=time.time)
    end: float | None = None
    steady_state_before: list[dict] = field(default_factory=list)
    steady_state_after: list[dict] = field(default_factory=list)
    run: list[dict] = field(default_factory=list)
    rollbacks: list[dict] = field(default_factory=list)
    invariants: list[dict] = field(default_factory=list)
    load: dict = field(default_factory=dict)
    mechanisms: list[str] = field(default_factory=list)
    error: str | None = None
    target: dict = field(default_factory=dict)

    def record(self, section: str, entry: dict) -> dict:
        entry.setdefault("at", round(time.time() - self.start, 3))
        getattr(self, section).append(entry)
        mech = (entry.get("output") or {}).get("mechanism") if isinstance(entry.get("output"), dict) else None
        if mech and mech not in self.mechanisms:
            self.mechanisms.append(mech)
        return entry

    def finish(self, status: str) -> None:
        assert status in STATUSES
        self.status = status
        self.end = time.time()

    def failed_invariants(self) -> list[dict]:
        return [i for i in self.invariants if i["status"] == "failed"]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["duration_s"] = round((self.end or time.time()) - self.start, 3)
        return d


def markdown(j: Journal) -> str:
    d = j.to_dict()
    lines = [
        f"# Drill `{j.drill}`: {j.title}",
        "",
        f"**Status: {j.status}** — {d['duration_s']} s, {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(j.start))}",
        "",
    ]
    if j.incident:
        lines += [f"Incident: {j.incident}", ""]
        if "seed" in j.incident:
            lines += [f"({SEED_NOTE}.)", ""]
    if j.error:
        lines += [f"Error: `{j.error}`", ""]
    if j.mechanisms:
        lines += ["Mechanisms used: " + "; ".join(f"`{m}`" for m in j.mechanisms), ""]
    lines += ["## Invariants", "", "| invariant | status | detail |", "|---|---|---|"]
    for i in j.invariants:
        lines.append(f"| {i['name']} | {i['status']} | {str(i.get('detail', '')).replace('|', '/')} |")
    if j.load:
        s = j.load.get("summary", {})
        lines += [
            "",
            "## Load (distbench)",
            "",
            (
                f"{s.get('total', '?')} requests: {s.get('ok', '?')} ok, {s.get('failed', '?')} failed with an "
                f"error; TTFT P50 {s.get('ttft_p50_ms', '?')} ms, P99 {s.get('ttft_p99_ms', '?')} ms; "
                f"E2E max {s.get('e2e_max_s', '?')} s"
            ),
        ]
        if s.get("errors"):
            lines += ["", "Errors seen: " + "; ".join(f"{k} ×{v}" for k, v in s["errors"].items())]
    lines += ["", "## Method", ""]
    for r in j.run:
        out = json.dumps(r.get("output"), default=str)
        lines.append(
            f"- t={r['at']} s `{r['name']}` ({r['type']}): {r['status']}"
            + (f" — {out[:300]}" if r.get("output") is not None else "")
            + (f" — error: {r['error']}" if r.get("error") else "")
        )
    lines += ["", "## Rollbacks", ""]
    lines += [f"- `{r['name']}`: {r['status']}" + (f" — {r['error']}" if r.get("error") else "") for r in j.rollbacks]
    for title, probes in (("before", j.steady_state_before), ("after", j.steady_state_after)):
        lines += ["", f"## Steady state {title}", ""]
        lines += [
            f"- {p['name']}: {'ok' if p['ok'] else 'DEVIATED'} (value {p.get('value')!r}, "
            f"tolerance {p.get('tolerance')!r})"
            for p in probes
        ]
    return "\n".join(lines) + "\n"


def write(j: Journal, out_dir: Path) -> tuple[Path, Path]:
    jp, mp = out_dir / "journal.json", out_dir / "report.md"
    atomic_write(jp, json.dumps(j.to_dict(), indent=1, default=str))
    atomic_write(mp, markdown(j))
    return jp, mp
