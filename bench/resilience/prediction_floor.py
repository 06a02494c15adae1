"""How well could any predictor of the router's view do? The TTFT prediction error of a router request journal
(``router.journal_path``, plain or gzipped) beside a floor: the best constant per state bucket, chosen in
hindsight on the same requests.

The router predicts a request's prefill call from the state it sees at admission (calls in flight on the prefill
worker, requests queued ahead). Requests that saw the same state are grouped (calls in flight x queued requests,
each capped at ``--cap``); in each group the one constant with the smallest P90 relative error over that group's
measured calls is chosen after the fact. No predictor that reads only those two figures can beat it on these
requests (it is fitted on them), so when its P90 is above an aim the aim needs information the router does not
have. Reported: the journal's own predictions (prefill-call part and whole TTFT) and the floor, median and P90 of
|predicted - measured| / measured, over the admitted requests that got a first token.

    .venv/bin/python -m bench.resilience.prediction_floor \
        bench/records/h200/resilience-overload-gpu/overload-open-7b-router-journal.jsonl.gz
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path


def _rows(path: Path) -> list[tuple[float, float, float, float, int, int]]:
    """(predicted call, measured call, predicted TTFT, measured TTFT, calls in flight, queued requests)."""
    opener = gzip.open if path.suffix == ".gz" else open
    rows = []
    with opener(path, "rt") as f:
        for line in f:
            r = json.loads(line)
            tp = r.get("ttft_parts")
            if r.get("status") != 200 or not tp or not r.get("ttft"):
                continue
            pred, meas, state = tp.get("predicted"), tp.get("measured"), tp.get("state") or {}
            if not pred or not meas or meas[1] is None or meas[1] <= 0:
                continue
            workers = list((state.get("workers") or {}).values())
            calls = min((w[1] for w in workers), default=0)
            rows.append((pred[1], meas[1], sum(pred), r["ttft"], calls, int(state.get("queued_requests", 0))))
    return rows


def _q(errors: list[float]) -> dict:
    s = sorted(errors)
    return {"samples": len(s), "median": round(s[len(s) // 2], 4), "p90": round(s[int(0.9 * len(s))], 4)} if s else {}


def _p90(c: float, xs: list[float]) -> float:
    e = sorted(abs(c - x) / x for x in xs)
    return e[int(0.9 * len(e))]


def floor(rows, cap: int) -> tuple[dict, int]:
    groups: dict[tuple[int, int], list[float]] = defaultdict(list)
    for _, meas, _, _, calls, queued in rows:
        groups[(min(calls, cap), min(queued, cap))].append(meas)
    errors: list[float] = []
    for xs in groups.values():
        s = sorted(xs)
        candidates = s[:: max(1, len(s) // 200)]
        best = min(candidates, key=lambda c: _p90(c, xs))
        errors += [abs(best - x) / x for x in xs]
    return _q(errors), len(groups)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("journal", type=Path, help="a router request journal (.jsonl or .jsonl.gz)")
    ap.add_argument("--cap", type=int, default=12, help="calls in flight and queued requests are capped at this")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = ap.parse_args()
    if not args.journal.is_file():
        print(f"prediction_floor: error: no journal at {args.journal}", file=sys.stderr)
        return 2
    if args.cap < 1:
        print(f"prediction_floor: error: --cap must be at least 1, got {args.cap}", file=sys.stderr)
        return 2
    rows = _rows(args.journal)
    if not rows:
        print(f"prediction_floor: error: {args.journal} has no admitted request with its TTFT parts", file=sys.stderr)
        return 2
    best, groups = floor(rows, args.cap)
    out = {
        "journal": str(args.journal),
        "prefill_call": _q([abs(p - m) / m for p, m, *_ in rows]),
        "ttft": _q([abs(p - m) / m for _, _, p, m, _, _ in rows]),
        "floor_prefill_call": best,
        "floor_groups": groups,
    }
    text = json.dumps(out, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
