"""``distbench repeat N --variant A='RUN ARGS' --variant B='RUN ARGS'``: N runs of each, interleaved.

A B A B ...: slow drifts of the machine (a neighbour's load, thermal state, a cache warming) fall on both
variants alike instead of on whichever ran second. Repeat ``i`` (1..N) of every variant runs with the
variant's ``--seed`` + i - 1, so the variants see the same prompts and arrival times in each round and no
two rounds repeat a prompt (a prefix cache would otherwise serve the later rounds). Results go to
``OUT/NAME_i.json``; with two variants the between-run ``compare`` of them is printed at the end.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from distserve.distbench.runner import UsageError


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, sep, rest = text.partition("=")
    name = name.strip()
    if not sep or not name or not name.replace("-", "").replace("_", "").isalnum():
        raise UsageError(f"--variant must be NAME='run arguments' (NAME letters, digits, - or _), got {text!r}")
    argv = shlex.split(rest)
    if "--save-result" in argv:
        raise UsageError(f"--variant {name}: leave out --save-result (repeat writes OUT/{name}_N.json)")
    return name, argv


def cmd_repeat(args) -> int:
    from distserve.distbench import result
    from distserve.distbench.compare import compare, format_report
    from distserve.distbench.load_args import options_from, run_parser
    from distserve.distbench.runner import run
    from distserve.distbench.summary import format_summary

    if args.n < 1:
        raise UsageError(f"repeat: N must be >= 1, got {args.n}")
    variants = [parse_variant(v) for v in args.variant]
    if len({n for n, _ in variants}) != len(variants):
        raise UsageError("repeat: two --variant share a name")
    parser = run_parser()
    parsed = []
    for name, argv in variants:
        try:
            parsed.append((name, parser.parse_args(argv)))
        except SystemExit:
            raise UsageError(f"--variant {name}: not valid arguments of distbench run (see above)") from None
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, list[str]] = {name: [] for name, _ in variants}
    for i in range(1, args.n + 1):
        for name, a in parsed:
            a.seed = a.seed + (1 if i > 1 else 0)  # seed + i - 1 for repeat i
            res = run(options_from(a))
            path = result.save(res, out / f"{name}_{i}.json")
            paths[name].append(str(path))
            print(f"[{name} {i}/{args.n}] {format_summary(res).splitlines()[0]}  -> {path}")
            if res["interrupted"] == "stopped by signal":
                print("repeat interrupted; results so far are in", out)
                return 130
    result.save(
        {"n": args.n, "variants": {n: " ".join(shlex.quote(x) for x in v) for n, v in variants}, "results": paths},
        out / "repeat.json",
    )
    if len(variants) == 2:
        (na, _), (nb, _) = variants
        rep = compare([result.load(p) for p in paths[na]], [result.load(p) for p in paths[nb]])
        print(format_report(rep, na, nb))
    return 0


def add_parser(sub, formatter) -> None:
    p = sub.add_parser(
        "repeat",
        help="run one or more configurations N times, interleaved (A B A B ...)",
        formatter_class=formatter,
        description=__doc__ + "\nExample: distbench repeat 3 --out-dir rep "
        "--variant A='--url http://127.0.0.1:8080 --request-rate 8 --num-prompts 200' "
        "--variant B='--url http://127.0.0.1:8081 --request-rate 8 --num-prompts 200'",
    )
    p.add_argument("n", type=int, help="runs of each variant")
    p.add_argument(
        "--variant",
        action="append",
        required=True,
        metavar="NAME=ARGS",
        help="a name and the distbench run arguments of one configuration (repeatable)",
    )
    p.add_argument("--out-dir", default="distbench-repeat", help="NAME_i.json per run, repeat.json")
    p.set_defaults(handler=cmd_repeat)
