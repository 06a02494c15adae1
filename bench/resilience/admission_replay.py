"""Admission decisions replayed offline on a router request journal (``router.journal_path``, plain or gzipped):
what today's TTFT predictor and admission rule would have decided on the same arrivals, beside what the journal
says was decided, per phase (``--phases`` JSON: the open loop's result with each rate's ``window_unix``, e.g.
bench/baselines/h200/overload-open-7b.json; without it, one phase).

How: each admitted request's prefill call is put back on the time line (sent ``measured call`` before its first
token, never before its arrival) and fed to the product's ``TtftPredictor`` (its ``WorkerQueue``: calls in
flight, running step, busy cost per token, idle calls) on a replayed clock; at each arrival (admitted or shed)
the predictor is asked the prefill part with the journal's queued prompt tokens; the decode-room wait and the
overhead are the journal's (for a shed request: the room part read back from its 429 message, which gives the
whole predicted TTFT). The margin is the product's (``slo_margin``) over measured / replayed-predicted TTFT of
every journal-admitted request judged (something queued), released at its first token. A request is admitted
when nothing is queued and no decode room is waited for, or prediction x margin <= SLO.

What it can tell: which of the requests the server really admitted the rule would have shed, and the TTFT
percentiles, share within SLO and goodput (within-SLO requests per second) of the rest, as measured; how many
it would have admitted of those the server shed. What it cannot: the TTFT of the latter (never measured), nor
how the queue, the stalls and everyone's TTFT would have moved had the server admitted otherwise (shedding
more shortens the queue: the replay's TTFT of the rest is pessimistic; admitting more lengthens it). Its
fidelity is reported: the replayed prediction against the journal's own on the admitted requests (meaningful
when the replayed code is the journal's), and the decisions of the journal's own rule replayed.

    .venv/bin/python -m bench.resilience.admission_replay \\
        bench/records/h200/resilience-overload-gpu/overload-open-7b-router-journal.jsonl.gz \\
        --phases bench/baselines/h200/overload-open-7b.json --slo-ms 250
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import re
import sys
from pathlib import Path

from bench.lib.results import write_result
from distserve.server.config import load_config
from distserve.server.router import ttft_predictor
from distserve.server.router.ttft_predictor import TtftPredictor

SHED_RE = re.compile(r"predicted TTFT (\d+(?:\.\d+)?) ms")


class _Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


class _NoRoom:
    """The decode room as the replay sees it: the journal's own room part is used, so the predictor is asked
    only for the prefill part (``_queued_best_ms``); this keeps it attached (phases mode)."""

    def releases_needed(self, ahead: int = 0) -> int:
        return 0

    def gates(self) -> bool:
        return True

    def total_slots(self) -> int:
        return 0

    def kv_bound(self) -> bool:
        return False


def _load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    out = []
    with opener(path, "rt") as f:
        for line in f:
            r = json.loads(line)
            if r.get("kind", "request") != "request" or r.get("status") not in (200, 429):
                continue
            if r["status"] == 200:
                tp = r.get("ttft_parts") or {}
                if not r.get("ttft") or not tp.get("predicted") or not (tp.get("measured") or [None, None])[1]:
                    continue
            else:
                m = SHED_RE.search(r.get("error") or "")
                if m is None:
                    continue  # shed for a bound or without a prediction: not an SLO decision
                r["_shed_pred"] = float(m.group(1)) / 1000.0
            out.append(r)
    out.sort(key=lambda r: r["start_unix"])
    return out


def _q(xs: list[float], p: float) -> float | None:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(p * len(s)) - 1))] if s else None


def replay(
    rows: list[dict], slo_s: float, own_default: int = 128, room_exempt: bool = False
) -> list[tuple[dict, float, float, bool]]:
    """(row, replayed predicted TTFT s, margin, admitted by the replayed rule), in arrival order; ``room_exempt``:
    the rule before 2026-12-07 (nothing queued admits even a request that would wait for decode room)."""
    clock = _Clock()
    p = TtftPredictor(load_config(), lambda: 1, clock=clock)
    p.attach(_NoRoom())
    ev: list[tuple[float, int, int]] = []  # (time, kind: 0 decision, 1 send, 2 answer, 3 first token, row)
    for i, r in enumerate(rows):
        ev.append((r["start_unix"], 0, i))
        if r["status"] == 200:
            end = r["start_unix"] + r["ttft"] - r["ttft_parts"]["measured"][2]
            ev.append((max(r["start_unix"] + 1e-6, end - r["ttft_parts"]["measured"][1]), 1, i))
            ev.append((max(r["start_unix"] + 2e-6, end), 2, i))
            ev.append((r["start_unix"] + r["ttft"], 3, i))
    ev.sort()
    calls: dict[int, object] = {}
    preds: dict[int, float] = {}
    out: list[tuple[dict, float, float, bool]] = []
    for t, kind, i in ev:
        clock.t = t
        r = rows[i]
        own = int(r.get("prompt_tokens") or own_default)
        if kind == 1:
            calls[i] = p.call_started("p0", own)
        elif kind == 2:
            p.call_ended(calls.pop(i), True)  # type: ignore[arg-type]
        elif kind == 3:
            if i in preds and r["ttft_parts"]["state"].get("queued_requests", 0) > 0:
                p.judged(preds[i], r["ttft"])
        else:
            idle_s = p.idle_call_ms(own) / 1000.0 if p.idle_calls else 0.0
            in_flight = sum(q.tokens for q in p.queues.values())
            if r["status"] == 200:
                st = r["ttft_parts"]["state"]
                room, over = r["ttft_parts"]["predicted"][0], r["ttft_parts"]["predicted"][2]
                queued_requests, queued_tokens = st.get("queued_requests", 0), st.get("queued_prefill_tokens", 0)
            else:
                queued_requests, queued_tokens, over = None, in_flight, 0.0
            q_s = p._queued_best_ms(own, queued_tokens, t) / 1000.0 if p.answered else idle_s
            if r["status"] != 200:  # the room part behind the 429's predicted TTFT: max(room + idle, queue)
                room = r["_shed_pred"] - idle_s if r["_shed_pred"] > max(q_s, idle_s) + 0.002 else 0.0
                room = max(0.0, room)
            pred = max(room + idle_s, q_s) + over
            margin = p.slo_margin()
            admit = (queued_requests == 0 and (room_exempt or room <= 0)) or pred * margin <= slo_s
            if r["status"] == 200:
                preds[i] = pred
            out.append((r, pred, margin, admit))
    return out


def _late(late, t0: float) -> dict:
    """The journal's admitted requests past the SLO: what was predicted, the measured parts (decode room, prefill
    call, the rest), how many with nothing queued, and the seconds (from the phase's start) they arrived in."""
    if not late:
        return {"count": 0}
    parts = [x[0]["ttft_parts"] for x in late]
    by_second: dict[int, int] = {}
    for x in late:
        k = int(x[0]["start_unix"] - t0)
        by_second[k] = by_second.get(k, 0) + 1
    return {
        "count": len(late),
        "nothing_queued": sum(1 for p in parts if p["state"].get("queued_requests", 0) == 0),
        "predicted_p50": _q([x[0]["predicted_ttft"] for x in late], 0.5),
        "measured_room_call_rest_p50": [_q([p["measured"][i] for p in parts], 0.5) for i in range(3)],
        "queued_requests_p10_p50_p90": [
            _q([p["state"].get("queued_requests", 0) for p in parts], q) for q in (0.1, 0.5, 0.9)
        ],
        "replayed_margin_p50": _q([x[2] for x in late], 0.5),
        "replay_admits": sum(1 for x in late if x[3]),
        "by_second": dict(sorted(by_second.items())),
    }


def summarize(decided, windows: dict[str, tuple[float, float]], slo_s: float) -> dict:
    res = {}
    for name, (a, b) in windows.items():
        d = [x for x in decided if a - 0.05 <= x[0]["start_unix"] <= b]
        if not d:
            continue
        adm = [x for x in d if x[0]["status"] == 200]
        kept = [x for x in adm if x[3]]
        tt = [x[0]["ttft"] for x in kept]
        tj = [x[0]["ttft"] for x in adm]
        errs = [abs(x[1] - x[0]["predicted_ttft"]) / x[0]["predicted_ttft"] for x in adm if x[0].get("predicted_ttft")]
        within = [x for x in tt if x <= slo_s]
        je = [abs(x[0]["predicted_ttft"] - x[0]["ttft"]) / x[0]["ttft"] for x in adm if x[0].get("predicted_ttft")]
        re_ = [abs(x[1] - x[0]["ttft"]) / x[0]["ttft"] for x in adm]
        res[name] = {
            "arrivals": len(d),
            "journal": {
                "admitted": len(adm),
                "shed_share": round(1 - len(adm) / len(d), 4),
                "ttft_p99_s": _q(tj, 0.99),
                "within_slo": round(sum(1 for x in tj if x <= slo_s) / max(1, len(tj)), 4),
                "goodput_rps": round(sum(1 for x in tj if x <= slo_s) / (b - a), 2),
            },
            "replay": {
                "of_admitted_shed": len(adm) - len(kept),
                "of_shed_admitted_ttft_unknown": sum(1 for x in d if x[0]["status"] == 429 and x[3]),
                "shed_share_upper": round(1 - len(kept) / len(d), 4),
                "ttft_p99_s": _q(tt, 0.99),
                "within_slo": round(len(within) / max(1, len(tt)), 4),
                "goodput_rps": round(len(within) / (b - a), 2),
                "margin_p50": _q([x[2] for x in d], 0.5),
            },
            "replayed_vs_journal_prediction_p50_p90": [_q(errs, 0.5), _q(errs, 0.9)],
            "ttft_error_p50_p90": {  # |predicted - measured| / measured TTFT of the admitted requests
                "journal": [_q(je, 0.5), _q(je, 0.9)],
                "replay": [_q(re_, 0.5), _q(re_, 0.9)],
            },
            "late_admitted": _late([x for x in adm if x[0]["ttft"] > slo_s], a),
        }
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("journal", type=Path, help="a router request journal (.jsonl or .jsonl.gz)")
    ap.add_argument("--phases", type=Path, default=None, help="the open loop's result JSON (each rate's window_unix)")
    ap.add_argument("--slo-ms", type=float, default=None, help="the TTFT SLO (default: the phases file's, else 250)")
    ap.add_argument(
        "--room-exempt",
        action="store_true",
        help="the rule before 2026-12-07: nothing queued admits a decode-room wait",
    )
    ap.add_argument("--margin-quantile", type=float, default=None, help="replay with this margin quantile")
    ap.add_argument("--margin-cap", type=float, default=None, help="replay with this margin cap")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = ap.parse_args()
    if args.margin_quantile is not None:
        ttft_predictor.MARGIN_QUANTILE = args.margin_quantile  # read by slo_margin at each call
    if args.margin_cap is not None:
        ttft_predictor.MARGIN_MAX = args.margin_cap
    if not args.journal.is_file():
        print(f"admission_replay: error: no journal at {args.journal}", file=sys.stderr)
        return 2
    windows: dict[str, tuple[float, float]] = {}
    slo_ms = args.slo_ms
    if args.phases is not None:
        doc = json.loads(args.phases.read_text())
        ol = doc.get("openloop", doc)
        slo_ms = slo_ms or ol.get("slo_ttft_ms")
        for k, v in ol.items():
            if isinstance(v, dict) and v.get("window_unix"):
                windows[k] = (float(v["window_unix"][0]), float(v["window_unix"][1]))
    rows = _load(args.journal)
    if not rows:
        print(f"admission_replay: error: {args.journal} has no admitted request with its TTFT parts", file=sys.stderr)
        return 2
    if not windows:
        windows["all"] = (rows[0]["start_unix"], rows[-1]["start_unix"] + 1e-3)
    slo_s = (slo_ms or 250.0) / 1000.0
    decided = replay(rows, slo_s, room_exempt=args.room_exempt)
    out = {
        "journal": str(args.journal),
        "slo_ms": slo_s * 1000,
        "room_exempt": args.room_exempt,
        "phases": summarize(decided, windows, slo_s),
    }
    print(json.dumps(out, indent=1))
    if args.out is not None:
        write_result(args.out, out)  # atomic, with provenance
    return 0


if __name__ == "__main__":
    sys.exit(main())
