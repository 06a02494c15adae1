"""How well could any predictor of the router's view do? The TTFT prediction error of a router request journal
(``router.journal_path``, plain or gzipped) beside a floor: the best constant per state bucket, chosen in
hindsight on the same requests.

The router predicts a request's prefill call from the state it sees at admission (calls in flight on the prefill
worker, requests queued ahead). Requests that saw the same state are grouped (calls in flight x queued requests,
each capped at ``--cap``); in each group the one constant with the smallest P90 relative error over that group's
measured calls is chosen after the fact. No predictor that reads only those two figures can beat it on these
requests (it is fitted on them), so when its P90 is above an aim the aim needs information the router does not
have. Beside it, ``online_fit``: the call predicted by a fit over (1, prefill steps, tokens) of the work ahead and the
request's own (``server/latency_model.py``'s step form, the config's batch limits), weighted for relative error and
forgetting (``--forget``), replayed in arrival order, each request predicted before its own call is observed: what a
fitted step model would have done on the same arrivals (admission's decisions not replayed). Reported: the journal's
own predictions (prefill-call part and whole TTFT), the online fit and the floor, median and P90 of
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

from bench.lib.results import write_result
from distserve.server.config import load_config
from distserve.server.latency_model import prefill_steps
from distserve.server.router.ttft_predictor import MIN_SAMPLES, OnlineFit


def _rows(path: Path) -> list[tuple]:
    """(predicted call, measured call, predicted TTFT, measured TTFT, calls in flight, queued requests, tokens in
    flight, queued prompt tokens, own prompt tokens, arrival), in arrival order."""
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
            calls, tokens = min(((w[1], w[0]) for w in workers), default=(0, 0))
            queued, queued_tokens = int(state.get("queued_requests", 0)), int(state.get("queued_prefill_tokens", 0))
            own = int(r.get("prompt_tokens") or 0)
            rows.append(
                (pred[1], meas[1], sum(pred), r["ttft"], calls, queued, tokens, queued_tokens, own, r["start_unix"])
            )
    rows.sort(key=lambda x: x[-1])
    return rows


def _q(errors: list[float]) -> dict:
    s = sorted(errors)
    return {"samples": len(s), "median": round(s[len(s) // 2], 4), "p90": round(s[int(0.9 * len(s))], 4)} if s else {}


def _p90(c: float, xs: list[float]) -> float:
    e = sorted(abs(c - x) / x for x in xs)
    return e[int(0.9 * len(e))]


def floor(rows, cap: int) -> tuple[dict, int]:
    groups: dict[tuple[int, int], list[float]] = defaultdict(list)
    for _, meas, _, _, calls, queued, *_ in rows:
        groups[(min(calls, cap), min(queued, cap))].append(meas)
    errors: list[float] = []
    for xs in groups.values():
        s = sorted(xs)
        candidates = s[:: max(1, len(s) // 200)]
        best = min(candidates, key=lambda c: _p90(c, xs))
        errors += [abs(best - x) / x for x in xs]
    return _q(errors), len(groups)


def online_fit(rows, forget: float) -> dict:
    cfg = load_config()
    batched, batch = cfg.prefill.max_num_batched_tokens, cfg.prefill.max_batch_size
    fit, errors = OnlineFit(3, forget), []
    for i, (_, meas, _, _, calls, queued, tokens, queued_tokens, own, _) in enumerate(rows):
        ahead = max(tokens, queued_tokens)  # in flight, and the queued ones not in flight yet (one prefill worker)
        steps = prefill_steps(ahead + own, max(calls, queued) + 1, batched, batch)
        x = (1.0, float(steps), (ahead + own) / 1000.0)
        if fit.count >= 2 * MIN_SAMPLES:
            errors.append(abs(max(1e-4, fit.predict(x)) - meas) / meas)
        fit.observe_relative(x, meas)
        if i % 4 == 0:
            fit.solve()
    return _q(errors)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("journal", type=Path, help="a router request journal (.jsonl or .jsonl.gz)")
    ap.add_argument("--cap", type=int, default=12, help="calls in flight and queued requests are capped at this")
    ap.add_argument("--forget", type=float, default=0.95, help="the online fit's forgetting per sample (0, 1]")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = ap.parse_args()
    if not args.journal.is_file():
        print(f"prediction_floor: error: no journal at {args.journal}", file=sys.stderr)
        return 2
    if args.cap < 1:
        print(f"prediction_floor: error: --cap must be at least 1, got {args.cap}", file=sys.stderr)
        return 2
    if not 0.0 < args.forget <= 1.0:
        print(f"prediction_floor: error: --forget must be in (0, 1], got {args.forget}", file=sys.stderr)
        return 2
    rows = _rows(args.journal)
    if not rows:
        print(f"prediction_floor: error: {args.journal} has no admitted request with its TTFT parts", file=sys.stderr)
        return 2
    best, groups = floor(rows, args.cap)
    out = {
        "journal": str(args.journal),
        "prefill_call": _q([abs(p - m) / m for p, m, *_ in rows]),
        "ttft": _q([abs(p - m) / m for _, _, p, m, *_ in rows]),
        "online_fit_prefill_call": online_fit(rows, args.forget),
        "floor_prefill_call": best,
        "floor_groups": groups,
    }
    print(json.dumps(out, indent=1))
    if args.out is not None:
        write_result(args.out, out)  # atomic, with provenance
    return 0


if __name__ == "__main__":
    sys.exit(main())
