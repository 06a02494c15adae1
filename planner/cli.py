"""Handlers of ``distserve profile`` and ``distserve plan`` (parsers: ``server/commands/planner.py``).

Bad input exits 2 with one sentence; nothing is measured or simulated before the arguments are checked.
"""

from __future__ import annotations

import sys
from pathlib import Path

from distserve.planner import deploy
from distserve.planner.layouts import AUTO_SPLITS, auto_splits, enumerate_layouts, split_layouts
from distserve.planner.profile import Profile, ProfileError, load
from distserve.planner.search import Evaluation, Planner
from distserve.planner.slo import SLO, SLOError
from distserve.planner.workload import WorkloadError, load_workload


def _err(sentence: str) -> int:
    print(f"distserve: error: {sentence}", file=sys.stderr)
    return 2


def cmd_profile(args) -> int:
    from distserve.server.launcher import parse_devices

    shares: list[int] = []
    if getattr(args, "sm_shares", None):
        try:
            shares = [int(x) for x in args.sm_shares.split(",") if x]
        except ValueError:
            return _err(f"--sm-shares must be percentages separated by commas, got {args.sm_shares!r}")
        if not shares or any(not 1 <= x <= 100 for x in shares):
            return _err(f"--sm-shares must be percentages in 1..100, got {args.sm_shares!r}")

    try:
        parse_devices(args.device)
    except ValueError as e:
        return _err(str(e))
    if args.transport not in ("tcp", "shm"):
        return _err(f"--transport must be tcp or shm, got {args.transport!r}")
    from distserve.planner.profiler import QUICK_CPU_SWEEP, measure

    sweep = QUICK_CPU_SWEEP if args.quick else None
    prof = measure(
        args.model,
        args.device,
        sweep,
        transport=args.transport,
        threads=not args.no_threads,
        serving=not args.no_serving,
        log=lambda s: print(s, file=sys.stderr, flush=True),
    )
    out = Path(args.out)
    if not out.parent.exists():
        return _err(f"--out folder {out.parent} does not exist")
    if shares:
        import dataclasses

        from distserve.planner.sm_shares import measure_shares

        points, notes, wrong = measure_shares(
            prof.model or None,
            args.device,
            sorted(set(shares) | {100}, reverse=True),
            log=lambda s: print(s, file=sys.stderr, flush=True),
        )
        prof = dataclasses.replace(
            prof, sm_shares=tuple(points), sm_shares_wrong=tuple(sorted(wrong)), notes=(*prof.notes, *notes)
        )
    prof.save(out)
    print(
        f"profile written: {out} ({len(prof.prefill)} prefill, {len(prof.decode)} decode, "
        f"{len(prof.kv_transfer)} KV points)"
    )
    return 0


def _inputs(args) -> tuple[Profile, Planner, list, int] | int:
    try:
        prof = load(args.profile)
    except ProfileError as e:
        return _err(str(e))
    try:
        slo = SLO.parse(args.slo, args.slo_form, args.slo_target)
    except SLOError as e:
        return _err(str(e))
    if args.devices is not None and args.devices < 1:
        return _err(f"--devices must be >= 1, got {args.devices}")
    if args.rate is not None and not args.rate > 0:
        return _err(f"--rate must be > 0, got {args.rate}")
    if args.num_requests < 10:
        return _err(f"--num-requests must be >= 10, got {args.num_requests}")
    try:
        wl = load_workload(args.workload, n=args.num_requests, seed=args.seed)
    except WorkloadError as e:
        return _err(str(e))
    from distserve.server.commands.common import load_args_config
    from distserve.server.config import ConfigError

    try:
        cfg = load_args_config(args)
    except ConfigError as e:
        return _err(str(e))
    longest = max(p + o for p, o in wl.requests)
    if longest > cfg.prefill.max_seq_len:
        return _err(
            f"the workload has requests of {longest} tokens (prompt + output), above prefill.max_seq_len "
            f"{cfg.prefill.max_seq_len}: pass a --config that serves them"
        )
    devices = args.devices or prof.devices_available
    try:
        batch = tuple(int(b) for b in args.batch_limits.split(",") if b) if args.batch_limits else ()
    except ValueError:
        return _err(f"--batch-limits must be whole numbers separated by commas, got {args.batch_limits!r}")
    if any(b < 1 for b in batch) or args.top < 1:
        return _err("--batch-limits values and --top must be >= 1")
    if args.write_config and not Path(args.write_config).resolve().parent.is_dir():
        return _err(f"--write-config folder {Path(args.write_config).parent} does not exist")
    layouts = enumerate_layouts(cfg, prof.device, devices, batch, prof.kv_bytes_per_token)
    splits = _splits(getattr(args, "sm_splits", "none"))
    if isinstance(splits, str):
        return _err(splits)
    if splits and prof.device == "cuda" and devices == 1:
        if not prof.sm_shares:
            if args.sm_splits != "auto":
                return _err("--sm-splits needs a profile with sm_shares: make it with distserve profile --sm-shares")
        else:
            wrong = prof.wrong_shares()
            if args.sm_splits == "auto":  # inside the measured shares (no extrapolation), no wrong-GEMM share
                phases = ("prefill", "decode")
                low = {ph: min((p.share for p in prof.sm_shares if p.phase == ph), default=101) for ph in phases}
                splits = auto_splits(low, wrong)
            else:
                bad = next((s for s in splits if s[0] in wrong or s[1] in wrong), None)
                if bad:
                    share = bad[0] if bad[0] in wrong else bad[1]
                    return _err(
                        f"--sm-splits {bad[0]}:{bad[1]} uses {share} % of the SMs, where the profile recorded wrong "
                        "bf16 GEMM results (a server refuses to start on it)"
                    )
            layouts += split_layouts(cfg, splits)
    if not layouts:
        return _err(f"no layout fits {devices} device(s)")
    planner = Planner.for_profile(prof, wl, slo, args.seed)
    return prof, planner, layouts, cfg.decode.max_batch_size


def _splits(text: str) -> tuple[tuple[int, int], ...] | str:
    """The --sm-splits value as (prefill %, decode %) pairs, or the error sentence."""
    if text in ("none", ""):
        return ()
    if text == "auto":
        return AUTO_SPLITS
    out = []
    for part in text.split(","):
        try:
            p, d = (int(x) for x in part.split(":"))
        except ValueError:
            return f"--sm-splits must be auto, none or P:D pairs like 60:40,100:50, got {text!r}"
        if not (1 <= p <= 100 and 1 <= d <= 100):
            return f"--sm-splits percentages must be in 1..100, got {part!r}"
        if (p, d) in out:
            return f"--sm-splits names {part!r} twice"
        out.append((p, d))
    return tuple(out)


def _row(e: Evaluation, device: str, rate: float | None, planner: Planner) -> str:
    unit = "core" if device == "cpu" else "GPU"
    head = f"{e.layout.name(device):<36} goodput {e.goodput:7.2f} req/s  {e.per_device:7.2f} per {unit}"
    if rate is not None:
        from distserve.planner.slo import attainment

        res = planner.run(e.layout, rate)
        head += f"  at {rate:g} req/s: attainment {attainment(planner.slo, res.latencies):.0%}"
    return f"{head}\n    bottleneck: {e.bottleneck}"


def cmd_plan(args) -> int:
    got = _inputs(args)
    if isinstance(got, int):
        return got
    prof, planner, layouts, base_batch = got
    evals = [planner.evaluate(lay) for lay in layouts]
    evals.sort(key=lambda e: (-e.per_device, -e.goodput, e.layout.workers))
    unit = "core" if prof.device == "cpu" else "GPU"
    wl = planner.workload
    print(
        f"profile: {prof.device_name}, model {prof.model or 'tiny (built-in)'}; workload {wl.spec} "
        f"(mean prompt {wl.mean_prompt:.0f}, output {wl.mean_output:.0f} tokens, {len(wl.requests)} requests); "
        f"SLO: {planner.slo.describe()}"
    )
    print(f"best layouts on {evals[0].devices} {unit}(s), by predicted goodput per {unit}:")
    for e in evals[: args.top]:
        print(_row(e, prof.device, args.rate, planner))
    best = evals[0]
    if best.goodput <= 0:
        print(
            "no layout meets the SLO at any rate on these devices: loosen the SLO (--slo), try shorter requests "
            "(--workload) or more --devices; a profile taken while other processes were busy predicts slow steps "
            "(see its thread-split lines): profile again on an idle machine"
        )
        return 1
    overrides = deploy.config_overrides(best.layout, base_batch, prof.device)
    cfg_path = args.config  # the deployment keeps the config the plan was made for
    if overrides:
        # written by default: the deploy line below names it (a command that points at a missing file fails)
        cfg_path = args.write_config or "plan.yaml"
        text = deploy.to_yaml(overrides, prof.model, base=args.config)
        Path(cfg_path).write_text(text)
        print(f"\nconfig (written to {cfg_path}; --write-config FILE to put it elsewhere):")
        print(text.rstrip())
    print("\ndeploy the winner:\n  " + deploy.serve_command(best.layout, prof.device, prof.model, cfg_path))
    if best.layout.mode == "colocated" and prof.device != "cpu":
        print(
            "  (a steady-state figure: a fresh colocated GPU worker stalls ~0.4 s on each of its first few mixed "
            "prefill+decode steps; warm it up before it takes load; docs/performance/planner.md, 'Cold start')"
        )
    if args.explain:
        rates = _explain_rates(evals[: args.top])
        print("\nattainment vs rate (req/s: attainment, TTFT P90 ms, TPOT P90 ms):")
        for e in evals[: args.top]:
            cells = "  ".join(f"{r:.3g}: {a:.0%} {tt:.0f}/{tp:.1f}" for r, a, tt, tp in planner.curve(e.layout, rates))
            print(f"  {e.layout.name(prof.device)}\n    {cells}")
    return 0


def _explain_rates(evals: list[Evaluation]) -> list[float]:
    top = max(e.goodput for e in evals) or 1.0
    return [round(top * f, 3) for f in (0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5)]
