"""``distserve profile | plan``: the placement planner's commands (handlers in the ``planner`` package,
imported inside them so the server's own commands never load it)."""

from __future__ import annotations


def _profile(args) -> int:
    from distserve.planner.cli import cmd_profile

    return cmd_profile(args)


def _plan(args) -> int:
    from distserve.planner.cli import cmd_plan

    return cmd_plan(args)


def add_parsers(sub) -> None:
    p = sub.add_parser(
        "profile",
        help="measure prefill/decode step and KV transfer times for the planner",
        description="Measure, through the real engine on the device, prefill step time vs (batch, "
        "tokens), decode step time vs (batch, context), KV pull time vs bytes over a real "
        "sender/receiver, and on CPU the thread split; write a profile JSON. Example: "
        "distserve profile --device cpu --out profile.json",
    )
    p.add_argument("--model", default=None, help="model to profile (default: the built-in tiny model)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--transport", default="tcp", help="KV transport to time: tcp or shm")
    p.add_argument("--no-threads", action="store_true", help="CPU: skip the thread-split measurements")
    p.add_argument(
        "--no-serving",
        action="store_true",
        help="skip the serving-path measurement (a real 1P1D distserve serve for a few requests)",
    )
    p.add_argument("--quick", action="store_true", help="CPU: a two-point sweep per phase (seconds, for tests)")
    p.add_argument(
        "--sm-shares",
        default=None,
        metavar="P,P,...",
        help="also time prefill and decode steps on these %% of the GPU's SMs (CUDA MPS clients, as --sm-split "
        "runs them; e.g. 30,40,50,60,100): what distserve plan's split search uses; nothing to measure on a CPU",
    )
    p.add_argument("--out", required=True, help="where to write the profile JSON")
    p.set_defaults(handler=_profile)

    p = sub.add_parser(
        "plan",
        help="recommend a layout (colocated or P prefill + D decode) for a workload and SLO",
        description="Simulate each layout that fits the devices on the profile and print the best by "
        "predicted goodput per device, with its bottleneck and the serve command. "
        "Example: distserve plan --profile profile.json --workload prompt=512,output=64 "
        "--slo ttft:250ms,tpot:50ms --devices 2 --explain",
    )
    p.add_argument(
        "--profile",
        required=True,
        help="a profile JSON from `distserve profile`, or a shipped profile's name "
        "(h200-llama2-7b: the H200, Llama-2-7B shape, bf16)",
    )
    p.add_argument(
        "--workload",
        required=True,
        help="prompt=N,output=M (distbench length syntax), sharegpt[:PATH][,output=M] or result:PATH",
    )
    p.add_argument("--slo", required=True, help="limits, e.g. ttft:250ms,tpot:50ms (ttft, tpot, e2el)")
    p.add_argument(
        "--slo-form",
        default="attainment",
        choices=["attainment", "p90", "p99"],
        help="attainment: >= --slo-target of requests meet every limit; p90/p99: that percentile does",
    )
    p.add_argument("--slo-target", type=float, default=0.9, help="share of requests for --slo-form attainment")
    p.add_argument(
        "--devices",
        type=int,
        default=None,
        help="GPUs (cuda profile) or cores (cpu profile) to place on (default: the profile's count)",
    )
    p.add_argument("--rate", type=float, default=None, help="also show each layout's attainment at this rate (req/s)")
    p.add_argument("--explain", action="store_true", help="print attainment vs rate for each listed layout")
    p.add_argument("--top", type=int, default=4, help="layouts to list")
    p.add_argument(
        "--batch-limits",
        default=None,
        help="extra decode batch limits to try, comma-separated (e.g. 16,32; default: the config's)",
    )
    p.add_argument(
        "--num-requests",
        type=int,
        default=400,
        help="request lengths drawn from the workload (a run of R req/s simulates max(this, 30 R))",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the lengths and arrival gaps")
    p.add_argument("--config", default=None, help="the config the deployment will use (batch limits, token budget)")
    p.add_argument("--write-config", default=None, metavar="FILE", help="write the winner's config overrides here")
    p.add_argument(
        "--sm-splits",
        default="auto",
        metavar="auto|none|P:D,...",
        help="one GPU (a cuda profile with sm_shares, --devices 1): also plan 1 prefill + 1 decode worker on these "
        "SM splits (auto: the disjoint 30:70 ... 80:20 and the overlapping P:D with both in 30..100 by 10 and "
        "100 < P + D <= 150, e.g. 100:50, inside the measured shares, never a share with wrong GEMMs); "
        "none: colocated only",
    )
    p.set_defaults(handler=_plan)
