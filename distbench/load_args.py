"""The arguments of a load run (``distbench run``, and the runs of ``sweep``, ``repeat`` and ``locust``) and
their translation into ``runner.Options``: one module every subcommand imports, importing no subcommand."""

from __future__ import annotations

import argparse

from distserve.distbench.runner import UsageError


class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows every default, except None/False (those options say what happens without them)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False or action.default == []:
            return action.help or ""
        return super()._get_help_string(action) or ""


def _percentiles(text: str) -> tuple[float, ...]:
    try:
        qs = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--percentiles must be numbers like 50,99,99.9, got {text!r}") from None
    if any(not 0 < q < 100 for q in qs):
        raise argparse.ArgumentTypeError("--percentiles must be in (0, 100)")
    return qs


ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/generate")


def add_load_args(r: argparse.ArgumentParser, sweep: bool = False) -> None:
    r.add_argument(
        "--url",
        required=True,
        help="server base URL, with or without a trailing /v1; a URL ending in an endpoint "
        "(http://h:8080/generate) also sets --endpoint",
    )
    r.add_argument(
        "--endpoint",
        default=None,
        choices=list(ENDPOINTS),
        help="the API to load (default: the one --url ends in, else /v1/completions)",
    )
    if not sweep:
        r.add_argument(
            "--strategy",
            default=None,
            choices=["closed", "poisson", "gamma", "constant", "trace"],
            help="arrivals (default: closed with --concurrency, gamma with --burstiness != 1, "
            "trace with --time-scale, else poisson)",
        )
        r.add_argument("--concurrency", type=int, default=None, help="closed loop: this many users")
        r.add_argument("--request-rate", type=float, default=None, help="open loop: requests per second")
        r.add_argument(
            "--max-concurrency",
            type=int,
            default=None,
            help="open loop: at most this many requests in flight; the others are sent late "
            "(and counted as late sends)",
        )
        r.add_argument(
            "--num-prompts",
            type=int,
            default=None,
            help="requests to send (default 100; with --duration the duration ends the run "
            "and this is an upper bound, default unlimited)",
        )
        r.add_argument("--duration", type=float, default=None, help="stop sending after this many seconds")
        r.add_argument("--time-scale", type=float, default=1.0, help="trace replay speed-up (2 = twice as fast)")
        r.add_argument(
            "--stop-on-saturation",
            action="store_true",
            help="end the run once the SLO attainment target can no longer be met",
        )
        r.add_argument("--save-result", default=None, help="write the result JSON here (atomically)")
    r.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of inter-arrival times; 1 = Poisson")
    r.add_argument("--dataset", default="random", help="random | sharegpt | sharegpt:PATH | jsonl:PATH")
    r.add_argument("--prompt-len", default="128", help="N, uniform:LO:HI or lognormal:MEDIAN:SIGMA (tokens)")
    r.add_argument(
        "--output-len",
        default=None,
        help="N, uniform:LO:HI or lognormal:MEDIAN:SIGMA (tokens; default 64 for random prompts, "
        "the dataset's own lengths for sharegpt and jsonl)",
    )
    r.add_argument("--prefix-len", type=int, default=0, help="shared system prompt of N tokens on every prompt")
    r.add_argument("--turns", type=int, default=1, help="multi-turn sessions of this many turns")
    r.add_argument(
        "--tokenizer", default=None, help="model folder whose vocabulary random prompts use (default: ask the server)"
    )
    r.add_argument("--warmup", type=int, default=0, help="requests sent first and left out of every figure")
    r.add_argument("--seed", type=int, default=0, help="seed of prompts, lengths and arrival times")
    r.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    r.add_argument("--slo", default=None, help="per-request SLO, e.g. ttft:250ms,tpot:50ms (ttft, tpot, itl, e2el)")
    r.add_argument("--slo-target", type=float, default=0.9, help="SLO attainment needed to pass (fraction)")
    r.add_argument(
        "--goodput",
        nargs="+",
        default=[],
        metavar="KEY:MS",
        help="vLLM's --goodput: request_goodput counts requests meeting these, e.g. ttft:250 tpot:50 "
        "(default: the --slo)",
    )
    r.add_argument(
        "--percentiles",
        type=_percentiles,
        default=(50.0, 90.0, 95.0, 99.0, 99.9),
        help="comma-separated, e.g. 50,99,99.9",
    )
    r.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    r.add_argument(
        "--token", default=None, help="admin token (default $DISTSERVE_ADMIN_TOKEN): scrape the workers' /metrics too"
    )
    r.add_argument("--no-progress", action="store_true", help="no live progress line")
    r.add_argument(
        "--compat",
        choices=["vllm"],
        default=None,
        help="vllm bench serve's definitions: TTFT/E2EL from the actual send, and its arrival schedule "
        "(first request one gap in, the n-th at exactly n/rate) (docs/DISTBENCH.md)",
    )
    r.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="after --duration: seconds the requests in flight may finish (after Ctrl-C: at most 5); "
        "the rest are recorded as cancelled",
    )
    r.add_argument(
        "--backoff",
        default="0.05:2",
        metavar="BASE:MAX",
        help="closed loop: after a request failed within MAX s its user waits a jittered back-off "
        "doubling from BASE up to MAX seconds before the next one (0 = none)",
    )
    r.add_argument(
        "--sampling",
        default="openai-default",
        help="greedy | openai-default (send no temperature/top_p, as the OpenAI SDK does: the server's "
        "defaults apply) | T,top_p[,top_k] (default: openai-default; recorded in the result)",
    )


def options_from(args, **spec_overrides):
    from distserve.distbench.loadgen import RunSpec
    from distserve.distbench.runner import Options, Workload, admin_token

    strategy = getattr(args, "strategy", None)
    conc, rate = getattr(args, "concurrency", None), getattr(args, "request_rate", None)
    if strategy is None:
        strategy = (
            "closed"
            if conc is not None
            else "trace"
            if getattr(args, "time_scale", 1.0) != 1.0
            else "gamma"
            if args.burstiness != 1.0
            else "poisson"
        )
    if strategy == "closed" and rate is not None:
        raise UsageError("give --concurrency (closed loop) or --request-rate (open loop), not both")
    if strategy not in ("closed", "trace") and rate is None and "request_rate" not in spec_overrides:
        raise UsageError("give --concurrency N (closed loop) or --request-rate R (open loop)")
    duration = getattr(args, "duration", None)
    num = getattr(args, "num_prompts", None)
    if num is None:
        num = 10**9 if duration else 100
    if args.turns < 1 or args.prefix_len < 0:
        raise UsageError("--turns must be >= 1 and --prefix-len >= 0")
    kw = {
        "url": base(args.url),
        "endpoint": _endpoint(args.url, args.endpoint),
        "strategy": strategy,
        "request_rate": rate,
        "burstiness": args.burstiness,
        "concurrency": conc,
        "max_concurrency": getattr(args, "max_concurrency", None),
        "num_prompts": num,
        "duration_s": duration,
        "warmup": args.warmup,
        "seed": args.seed,
        "model": args.model,
        "timeout_s": args.timeout,
        "time_scale": getattr(args, "time_scale", 1.0),
        "sampling": getattr(args, "sampling", "openai-default"),
    }
    kw.update(_backoff(args.backoff))
    kw["vllm_schedule"] = getattr(args, "compat", None) == "vllm"
    kw["drain_s"] = args.drain_timeout
    kw["grace_s"] = min(5.0, max(0.0, args.drain_timeout))  # Ctrl-C: at most 5 s, never more than the drain
    kw.update(spec_overrides)
    try:
        spec = RunSpec(**kw)
    except ValueError as e:
        raise UsageError(str(e)) from None
    w = Workload(args.dataset, args.prompt_len, args.output_len, args.prefix_len, args.turns, args.tokenizer, args.seed)
    return Options(
        spec,
        w,
        args.slo,
        tuple(args.goodput),
        args.slo_target,
        args.percentiles,
        getattr(args, "stop_on_saturation", False),
        not args.no_progress,
        admin_token(args.token),
        compat=getattr(args, "compat", None),
    )


def _backoff(text: str) -> dict:
    base, _, top = str(text).partition(":")
    try:
        b = float(base)
        m = float(top) if top else max(b, 2.0)
    except ValueError:
        raise UsageError(f"--backoff must be BASE:MAX seconds like 0.05:2 (or 0), got {text!r}") from None
    if b == 0:
        return {"backoff_s": 0.0, "backoff_max_s": max(m, 0.0)}
    return {"backoff_s": b, "backoff_max_s": m}


def base(url: str) -> str:
    from distserve.distbench.client import base_url, split_endpoint

    if not url.startswith(("http://", "https://")):
        raise UsageError(f"--url must start with http:// or https://, got {url!r}")
    return base_url(split_endpoint(url)[0])


def _endpoint(url: str, given: str | None) -> str:
    """--endpoint, or the endpoint --url ends in (the source article's --url http://h:8080/generate)."""
    from distserve.distbench.client import split_endpoint

    in_url = split_endpoint(url)[1]
    if given and in_url and given != in_url:
        raise UsageError(
            f"--url ends in {in_url} but --endpoint is {given}: give the server's base URL with --endpoint"
        )
    return given or in_url or "/v1/completions"


def run_parser() -> argparse.ArgumentParser:
    """A parser of ``distbench run``'s arguments alone (``repeat`` parses each variant with it)."""
    p = argparse.ArgumentParser(prog="distbench run", formatter_class=Formatter)
    add_load_args(p)
    return p
