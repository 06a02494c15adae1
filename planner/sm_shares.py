"""Engine steps on shares of one GPU's SMs: the curve the planner's split search uses (``Profile.sm_shares``).

Each share runs in its own process, a CUDA MPS client with ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` = the share, of
a control daemon started here (``server.mps.MpsDaemon``: its own private folder, stopped at the end), so the
share applies exactly as ``distserve serve --sm-split`` applies it. The child builds the real engine and times
``SHARE_SWEEP``'s prefill and decode steps (``planner.profiler.EngineProbe``: the minimum of repeats), and prints
them as one JSON line. The shares are measured in the order given and each is skipped (with a note) once
``budget_s`` would be exceeded, so a deadline still returns what was measured.

A share measured alone is the step's cost on that many SMs with the rest of the GPU idle; in a split the other
client also uses memory bandwidth, which this curve does not show (the serving benchmark does). Where the two
clients' shares overlap (P + D > 100) and both are in a step, the simulator runs each on ``contended_share``.

Each child first runs the start-up check of a worker under ``--sm-split`` (``server.mps.gemm_self_check``): a
share whose bf16 GEMMs come out wrong (on an H200 with torch 2.11 + cu130: 40 % and 45 % of the SMs) is not
measured, with a note, so the split search (``auto``: inside the measured shares) never proposes it.

On the CPU there is nothing to measure: the shares apply to MPS clients only (``measure_shares`` returns no
point and says so).

Device: ``python3 -m distserve.planner.sm_shares --device cuda --model preset:llama-2-7b --shares 100,40,60,30,50
--out $OUT/sm_shares.json`` (one engine start per share).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from distserve.planner.profile import SharePoint

# (batch, prompt tokens) and (batch, context): a short and a long prompt, a small and a large decode batch
SHARE_SWEEP = {"prefill": ((1, 512), (1, 2048)), "decode": ((16, 512), (64, 1024))}
DECODE_STEPS, REPEATS = 16, 3


def measure_shares(
    model: str | None,
    device: str,
    shares: list[int],
    log=print,
    budget_s: float = 1e9,
    start_estimate_s: float = 30.0,
    progress=lambda points, notes: None,
) -> tuple[list[SharePoint], list[str], list[int]]:
    """(points, notes, shares whose GEMMs came out wrong), ``progress`` called after each share. CPU: no points, a
    note saying why."""
    if not device.startswith("cuda"):
        msg = "SM shares apply to CUDA MPS clients (distserve serve --sm-split): on the CPU there is nothing to measure"
        log(msg)
        return [], [msg], []
    from distserve.server.mps import MpsDaemon

    t0 = time.monotonic()
    daemon = MpsDaemon().start()
    points: list[SharePoint] = []
    notes: list[str] = []
    wrong: list[int] = []
    index = int(device.split(":")[1]) if ":" in device else 0
    try:
        for share in shares:
            if time.monotonic() - t0 + start_estimate_s > budget_s:
                notes.append(f"share {share} % not measured (time budget)")
                continue
            env = {**os.environ, **daemon.env(share, None, index)}
            cmd = [
                sys.executable,
                "-m",
                "distserve.planner.sm_shares",
                "--child",
                "--device",
                device,
                "--model",
                model or "",
            ]
            left = max(start_estimate_s, budget_s - (time.monotonic() - t0))
            try:
                p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=min(600, left), check=False)
            except subprocess.TimeoutExpired:
                notes.append(f"share {share} %: the child did not finish in {left:.0f} s")
                continue
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
            if p.returncode != 0 or not lines:
                notes.append(f"share {share} %: the child failed ({(p.stderr or p.stdout).strip()[-300:]})")
                log(notes[-1])
                continue
            got = json.loads(lines[-1])
            if "wrong" in got:  # not measured, so `plan --sm-splits auto` never proposes a split that uses it
                notes.append(f"share {share} % not measured: {got['wrong']}")
                wrong.append(share)
                log(notes[-1])
                continue
            for phase, rows in (("prefill", got["prefill"]), ("decode", got["decode"])):
                for batch, size, ms in rows:
                    points.append(SharePoint(phase, share, batch, size, ms))
            log(f"SM share {share} %: {got}")
            progress(points, notes)
    finally:
        daemon.stop()
    return points, notes, wrong


def contended_share(own: int, other: int) -> float:
    """The share of the SMs a client of an MPS split runs on while the other client is in a step too.

    MPS thread percentages are caps, not reservations: with ``own + other`` <= 100 the two never compete for an SM
    and each keeps its own share; above 100 (an overlapping split such as 100:50) the model divides the SMs in
    proportion to the caps while both run, ``100 x own / (own + other)``, never more than the cap: 100:50 gives
    66.7 % and 33.3 %. While the other client is idle a client runs on its own share."""
    total = own + other
    return float(own) if total <= 100 else min(float(own), 100.0 * own / total)


def _child(model: str | None, device: str) -> None:
    import torch

    from distserve.planner.profiler import EngineProbe
    from distserve.server.mps import gemm_self_check

    wrong = gemm_self_check(torch.device(device))  # a share that computes wrong results has no step time
    if wrong is not None:
        print(json.dumps({"wrong": wrong}), flush=True)
        return

    longest = max(n for _, n in SHARE_SWEEP["prefill"]) + 64
    batch, ctx = max(SHARE_SWEEP["decode"])
    tokens = batch * (ctx + DECODE_STEPS * (REPEATS + 1) + 2) + longest
    probe = EngineProbe(model, device, max_len=max(4096, longest), num_blocks=tokens // 16 + 64)
    out: dict = {"prefill": [], "decode": []}
    for batch, tokens in SHARE_SWEEP["prefill"]:
        out["prefill"].append([batch, tokens, round(probe.prefill_ms(batch, tokens, REPEATS), 4)])
    for batch, ctx in SHARE_SWEEP["decode"]:
        out["decode"].append([batch, ctx, round(probe.decode_ms(batch, ctx, DECODE_STEPS, REPEATS), 4)])
    print(json.dumps(out), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="preset:llama-2-7b", help="'' = the built-in tiny model")
    ap.add_argument("--shares", default="100,40,60,30,50")
    ap.add_argument("--budget-s", type=float, default=1e9)
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args.model or None, args.device)
        return 0
    shares = [int(s) for s in args.shares.split(",") if s]
    doc: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args)}
    from distserve.planner.latency import share_scales

    def write(points, notes) -> str:
        doc["points"] = [p.__dict__ for p in points]
        doc["notes"] = notes
        doc["scale"] = {ph: list(v) for ph, v in share_scales(points).items()}
        text = json.dumps(doc, indent=1)
        if args.out:
            Path(args.out).write_text(text)
        return text

    points, notes, wrong = measure_shares(
        args.model or None, args.device, shares, budget_s=args.budget_s, progress=write
    )
    doc["wrong"] = wrong
    print(write(points, notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
