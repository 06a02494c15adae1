"""The one adapter from request records on disk to what the audit needs.

Two sources, one shape (``Record``):

- distbench result files (JSON): per-request records under ``requests`` with
  ``scheduled`` (seconds from the run's start), ``ttft``/``e2e``/``tpot`` (seconds),
  ``itl`` (list of seconds), ``error``, and, in newer files, ``start_unix`` (wall-clock
  time of the scheduled send) and ``warmup`` (warm-up requests are left out, as distbench
  leaves them out of its own figures);
- the router's request journal (JSON lines, ``router.journal_path``): one object per
  request that reached the router with ``start_unix``, the same latency fields, ``pool`` and
  ``status`` (the outcome: 200, 5xx, 429, or a client fault: other 4xx, 499 client gone or too slow
  to read). Client faults are counted (``RecordSet.client_errors``) and left out of the audit: they
  say nothing about the server's availability. ``journal_gap`` lines (the router could not write
  some records: ``server/router/journal.py``) become ``RecordSet.gaps``; other kinds (e.g. breaker
  events) are skipped.

A change of either format is an edit here and nowhere else. Records are windowed
by ``start_unix`` when every record has it (windows then align to the clock),
else by ``scheduled`` offsets from the run's start.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Gap", "Record", "RecordsError", "RecordSet", "load_records"]


class RecordsError(ValueError):
    """A results file cannot be read as request records; the message names the file."""


@dataclass(frozen=True)
class Record:
    start: float  # unix seconds (clock "unix") or seconds from the run's start (clock "relative")
    ok: bool
    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None
    itl: tuple[float, ...] = ()
    error: str | None = None
    pool: str | None = None

    def values(self, metric: str) -> tuple[float, ...]:
        """The samples this request contributes to ``metric`` (ITL: one per gap; others: at most one)."""
        if not self.ok:
            return ()
        if metric == "itl":
            return self.itl
        v = getattr(self, metric)
        return () if v is None else (v,)


@dataclass(frozen=True)
class Gap:
    """A period in which the router dropped journal records (``until`` None: never closed)."""

    since: float
    until: float | None
    dropped: int | None  # None: unknown (the gap was never closed)
    source: str

    def overlaps(self, start: float, end: float) -> bool:
        return self.since < end and (self.until is None or self.until >= start)


@dataclass(frozen=True)
class RecordSet:
    records: tuple[Record, ...]
    clock: str  # "unix" | "relative"
    sources: tuple[str, ...]
    gaps: tuple[Gap, ...] = ()
    client_errors: int = 0  # journaled requests refused for the client's own fault (4xx but 429, 499)


def _is_client_error(status: Any) -> bool:
    return isinstance(status, int) and not isinstance(status, bool) and 400 <= status < 500 and status != 429


def _num(path: Path, i: int, d: dict, key: str) -> float | None:
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise RecordsError(f"{path}: request {i}: {key!r} must be a non-negative number or null, got {v!r}")
    return float(v)


def _record(path: Path, i: int, d: Any, start_key: str) -> Record:
    if not isinstance(d, dict):
        raise RecordsError(f"{path}: request {i} is not an object")
    start = _num(path, i, d, start_key)
    if start is None:
        raise RecordsError(f"{path}: request {i} has no {start_key!r}")
    itl = d.get("itl") or []
    if not isinstance(itl, list) or not all(
        isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0 for x in itl
    ):
        raise RecordsError(f"{path}: request {i}: 'itl' must be a list of finite non-negative numbers")
    error = d.get("error")
    ttft = _num(path, i, d, "ttft")
    return Record(
        start=start,
        ok=error is None and ttft is not None,
        ttft=ttft,
        tpot=_num(path, i, d, "tpot"),
        e2e=_num(path, i, d, "e2e"),
        itl=tuple(float(x) for x in itl),
        error=None if error is None else str(error),
        pool=d.get("pool"),
    )


def _distbench(path: Path, doc: dict) -> tuple[list[Record], str]:
    reqs = doc["requests"]
    if not isinstance(reqs, list):
        raise RecordsError(f"{path}: 'requests' must be a list of per-request records")
    reqs = [r for r in reqs if not (isinstance(r, dict) and r.get("warmup"))]
    unix = bool(reqs) and all(isinstance(r, dict) and r.get("start_unix") for r in reqs)  # 0 = not recorded
    key = "start_unix" if unix else "scheduled"
    return [_record(path, i, r, key) for i, r in enumerate(reqs)], "unix" if unix else "relative"


def _journal(path: Path, text: str) -> tuple[list[Record], list[Gap], int]:
    out: list[Record] = []
    gaps: list[Gap] = []
    open_since: float | None = None
    client_errors = 0
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise RecordsError(f"{path}:{n}: not a JSON line: {e.msg}") from None
        if not isinstance(d, dict):
            raise RecordsError(f"{path}:{n}: not a JSON object")
        kind = d.get("kind", "request")
        if kind == "journal_gap":
            since = _num(path, n, d, "since_unix")
            if since is None:
                raise RecordsError(f"{path}:{n}: journal_gap has no 'since_unix'")
            if d.get("open"):
                open_since = since if open_since is None else open_since
                continue
            until = _num(path, n, d, "until_unix")
            dropped = _num(path, n, d, "dropped")
            gaps.append(Gap(since, until, None if dropped is None else int(dropped), str(path)))
            open_since = None
            continue
        if kind != "request":
            continue
        rec = _record(path, n, d, "start_unix")
        if _is_client_error(d.get("status")):
            client_errors += 1
            continue
        out.append(rec)
    if open_since is not None:  # the router never wrote again after the drops began
        gaps.append(Gap(open_since, None, None, str(path)))
    return out, gaps, client_errors


def _load_one(path: Path) -> tuple[list[Record], str, list[Gap], int]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise RecordsError(f"{path}: cannot read: {getattr(e, 'strerror', None) or e}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        doc = None  # maybe JSON lines
    if isinstance(doc, dict) and "requests" in doc:
        recs, clock = _distbench(path, doc)
        return recs, clock, [], 0
    if isinstance(doc, dict) and "start_unix" not in doc and doc.get("kind") != "journal_gap":
        raise RecordsError(f"{path}: a JSON object without 'requests': not a distbench result file")
    if doc is not None and not isinstance(doc, dict):
        raise RecordsError(
            f"{path}: expected a distbench result (JSON object) or a request journal "
            f"(JSON lines), got a JSON {type(doc).__name__}"
        )
    recs, gaps, client_errors = _journal(path, text)
    return recs, "unix", gaps, client_errors


def load_records(paths: list[str | Path]) -> RecordSet:
    """Read every file; all must share one clock (wall-clock windows need ``start_unix`` everywhere)."""
    if not paths:
        raise RecordsError("no results files given")
    records: list[Record] = []
    gaps: list[Gap] = []
    client_errors = 0
    clocks = {}
    for p in paths:
        recs, clock, file_gaps, n_client = _load_one(Path(p))
        records.extend(recs)
        gaps.extend(file_gaps)
        client_errors += n_client
        clocks[str(p)] = clock
    if len(set(clocks.values())) > 1:
        rel = [p for p, c in clocks.items() if c == "relative"]
        raise RecordsError(
            f"cannot window these files together: {', '.join(rel)} lack 'start_unix' "
            f"(wall-clock send times) while the others have it"
        )
    if not records:
        raise RecordsError(f"no request records in {', '.join(map(str, paths))}")
    return RecordSet(tuple(records), next(iter(clocks.values())), tuple(map(str, paths)), tuple(gaps), client_errors)
