"""Subcommands beyond ``run``: sweep, compare, plot, merge, demo."""

from __future__ import annotations

import json
import math
from pathlib import Path

from distserve.distbench.runner import UsageError
from distserve.distbench.validate import load_checked


def _load_all(paths: list[str]) -> list[dict]:
    from distserve.distbench import result

    out = []
    for p in paths:
        try:
            out.append(result.load(p) if not p.endswith("sweep.json") else json.loads(Path(p).read_text()))
        except (ValueError, OSError) as e:
            raise UsageError(str(e)) from None
    return out


def cmd_sweep(args) -> int:
    from distserve.distbench.load_args import options_from
    from distserve.distbench.sweep import format_table, sweep

    if not args.slo:
        raise UsageError("sweep needs --slo (the SLO whose attainment decides each rate)")
    if args.rate_start <= 0 or args.precision <= 0 or args.max_runs < 2 or args.min_duration < 0:
        raise UsageError("--rate-start and --precision must be > 0, --max-runs >= 2 and --min-duration >= 0")
    opts = options_from(
        args,
        request_rate=args.rate_start,
        strategy="gamma" if args.burstiness != 1 else "poisson",
        num_prompts=args.num_prompts,
        duration_s=args.duration,
    )
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    try:
        s = sweep(
            opts,
            args.rate_start,
            args.precision,
            args.max_runs,
            out,
            args.max_rate or math.inf,
            min_duration_s=args.min_duration,
        )
    except KeyboardInterrupt:
        print("sweep interrupted; results so far are in", out)
        return 130
    print(format_table(s))
    print(f"saved {out / 'sweep.json'}")
    if args.plot:
        from distserve.distbench.plot import PlotUnavailable, plot

        try:
            for p in plot([("sweep", s)], out):
                print(f"wrote {p}")
        except PlotUnavailable as e:
            raise UsageError(str(e)) from None
    return 0 if s["goodput_rate"] else 1


def _side_name(paths: list[str]) -> str:
    return Path(paths[0]).stem if len(paths) == 1 else f"{Path(paths[0]).stem} .. {Path(paths[-1]).stem}"


def cmd_compare(args) -> int:
    from distserve.distbench.compare import compare, format_report, split_sides

    try:
        pa, pb = split_sides(args.results)
    except ValueError as e:
        raise UsageError(str(e)) from None
    a, b = load_checked(pa), load_checked(pb)
    rep = compare(a, b, args.resamples, args.seed)
    if not rep["rows"]:
        raise UsageError("no completed requests to compare in one of the results")
    print(format_report(rep, _side_name(pa), _side_name(pb)))
    if args.json:
        from distserve.distbench.result import save

        save({"a": pa, "b": pb, **rep}, args.json)
    return 0


def cmd_plot(args) -> int:
    from distserve.distbench.plot import PlotUnavailable, plot

    results = _load_all(args.results)
    try:
        paths = plot([(Path(p).stem, r) for p, r in zip(args.results, results)], Path(args.out_dir))
    except PlotUnavailable as e:
        raise UsageError(str(e)) from None
    for p in paths:
        print(f"wrote {p}")
    return 0


def cmd_merge(args) -> int:
    from distserve.distbench import result
    from distserve.distbench.merge import merge
    from distserve.distbench.summary import format_summary

    merged = merge(load_checked(args.results))
    print(f"saved {result.save(merged, args.output)}")
    print(format_summary(merged))
    return 0


def add_parsers(sub, formatter, add_load_args) -> None:
    from distserve.distbench import demo

    s = sub.add_parser(
        "sweep",
        help="find the highest rate meeting the SLO attainment target",
        formatter_class=formatter,
        description="Bracket (double/halve the rate) then bisect the highest open-loop rate whose "
        "SLO attainment >= --slo-target. Example: distbench sweep --url "
        "http://127.0.0.1:8080 --slo ttft:250ms,tpot:50ms --num-prompts 200 --out-dir sw",
    )
    add_load_args(s, sweep=True)
    s.add_argument(
        "--num-prompts", type=int, default=100, help="requests per rate, at least (--min-duration may ask for more)"
    )
    s.add_argument(
        "--min-duration",
        type=float,
        default=30.0,
        help="seconds of sending per rate, at least (rate x this requests): a steady state, not a burst; "
        "a short value (e.g. 2 for a CPU test) is allowed but says less",
    )
    s.add_argument("--duration", type=float, default=None, help="seconds of sending per rate (instead of a count)")
    s.add_argument("--rate-start", type=float, default=1.0, help="first rate tried (req/s)")
    s.add_argument("--max-rate", type=float, default=None, help="never try above this rate")
    s.add_argument("--precision", type=float, default=0.1, help="stop bisecting when hi/lo - 1 is below this")
    s.add_argument("--max-runs", type=int, default=10, help="runs at most, bracketing and bisecting together")
    s.add_argument("--out-dir", default="distbench-sweep", help="one result per rate, sweep.json, vs_rate.png")
    s.add_argument("--plot", action="store_true", help="also write vs_rate.png (needs matplotlib)")
    s.set_defaults(handler=cmd_sweep)

    c = sub.add_parser(
        "compare",
        help="A vs B: mean/P95/P99/std with change %% and a significance test over runs",
        formatter_class=formatter,
        description="Several runs per side test between runs (run-to-run variance covered): "
        "distbench compare a1.json a2.json a3.json vs b1.json b2.json b3.json. With one run per side "
        "(distbench compare a.json b.json) only within-run variance is covered and the verdict is "
        "'not established'. Differing settings are named.",
    )
    c.add_argument("results", nargs="+", metavar="RESULT", help="A's results, 'vs', B's results (or just A B)")
    c.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples")
    c.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    c.add_argument("--json", default=None, help="also write the table here")
    c.set_defaults(handler=cmd_compare)

    p = sub.add_parser(
        "plot",
        help="PNG plots: CDFs, latency/attainment vs rate, timeline",
        formatter_class=formatter,
        description="Example: distbench plot a.json b.json --out-dir plots (needs matplotlib: "
        "pip install 'distserve[bench]')",
    )
    p.add_argument("results", nargs="+", help="run results and/or sweep.json files")
    p.add_argument("--out-dir", default="distbench-plots", help="where the PNGs go")
    p.set_defaults(handler=cmd_plot)

    m = sub.add_parser(
        "merge",
        help="merge results losslessly (HDR histograms added)",
        formatter_class=formatter,
        description="Example: distbench merge w1.json w2.json -o all.json",
    )
    m.add_argument("results", nargs="+", help="distbench result JSONs")
    m.add_argument("-o", "--output", required=True)
    m.set_defaults(handler=cmd_merge)

    demo.add_parser(sub, formatter)
    from distserve.distbench import locust_cmd, repeat

    repeat.add_parser(sub, formatter)
    locust_cmd.add_parser(sub, formatter)
