"""``distbench locust``: Locust drives the load (headless; one process, or a master with local workers),
distbench's locustfile records raw timings into HDR, and the per-process results are merged into one
distbench result (``distbench merge``'s lossless rule). Needs ``pip install 'distserve[locust]'``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from distserve.distbench import result
from distserve.distbench.datasets import Vocab
from distserve.distbench.merge import merge
from distserve.distbench.metrics import meets, parse_slo
from distserve.distbench.runner import UsageError, probe, verdict

LOCUSTFILE = Path(__file__).with_name("locustfile.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_locust(
    url: str,
    users: int,
    spawn_rate: float,
    run_time_s: float,
    workers: int,
    prompt_len: int,
    output_len: int,
    slo: str | None,
    slo_target: float,
    token: str | None,
    seed: int = 0,
    tokenizer: str | None = None,
) -> dict:
    if importlib.util.find_spec("locust") is None:  # not imported here: it monkey-patches the process
        raise UsageError(
            "distbench locust needs Locust: pip install -e '.[locust]' in a distserve checkout "
            "('distserve[locust]' where distserve comes from an index)"
        )
    try:
        slo_s = parse_slo(slo)
    except ValueError as e:
        raise UsageError(str(e)) from None
    info = asyncio.run(probe(url, token))
    if tokenizer:
        try:
            info["vocab_size"] = Vocab.from_tokenizer(tokenizer).size
        except ValueError as e:
            raise UsageError(str(e)) from None
    if not info.get("vocab_size"):
        raise UsageError("the server did not say its vocabulary; give --tokenizer MODEL_DIR or --token")
    with tempfile.TemporaryDirectory(prefix="distbench-locust-") as out:
        cfg = {
            "prompt_len": prompt_len,
            "output_len": output_len,
            "vocab_size": info["vocab_size"],
            "model": info.get("model"),
            "out_dir": out,
            "users": users,
            "seed": seed,
        }
        env = dict(os.environ, DISTBENCH_LOCUST=json.dumps(cfg))
        base = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--loglevel", "WARNING"]
        load = [
            "--headless",
            "-u",
            str(users),
            "-r",
            str(spawn_rate),
            "-t",
            f"{int(run_time_s)}s",
            "-H",
            url,
            "--only-summary",
            "--stop-timeout",
            "30",
        ]
        procs: list[subprocess.Popen] = []
        try:
            if workers:
                port = _free_port()
                master = subprocess.Popen(
                    [
                        *base,
                        *load,
                        "--master",
                        "--expect-workers",
                        str(workers),
                        "--master-bind-host",
                        "127.0.0.1",
                        "--master-bind-port",
                        str(port),
                    ],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
                procs.append(master)
                for _ in range(workers):
                    procs.append(
                        subprocess.Popen(
                            [*base, "--worker", "--master-host", "127.0.0.1", "--master-port", str(port)],
                            env=env,
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL,
                        )
                    )
            else:
                master = subprocess.Popen(
                    [*base, *load], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
                )
                procs.append(master)
            log, _ = master.communicate(timeout=run_time_s + 180)
            for p in procs[1:]:
                p.wait(60)
        finally:
            for p in procs:  # by PID, only what we started
                if p.poll() is None:
                    p.terminate()
                    try:
                        p.wait(10)
                    except subprocess.TimeoutExpired:
                        p.kill()
        parts = [result.load(p) for p in sorted(Path(out).glob("locust-*.json"))]
    if not parts:
        raise RuntimeError(f"Locust produced no records; its log:\n{log[-2000:]}")
    res = merge(parts)
    recs = result.records_of(res)
    res["num_locust_processes"] = len(parts)
    res["config"] = {
        "driver": "locust",
        "users": users,
        "spawn_rate": spawn_rate,
        "run_time_s": run_time_s,
        "workers": workers,
        "prompt_len": prompt_len,
        "output_len": output_len,
        "slo": slo,
        "server": info,
    }
    if slo_s:
        res["slo"] = {k: v * 1000 for k, v in slo_s.items()}
        res["slo_met"] = sum(meets(r, slo_s) for r in recs)
        res["slo_attainment"] = res["slo_met"] / len(recs) if recs else 0.0
    res["slo_target"] = slo_target
    res["verdict"] = verdict(res)
    res["locust_summary"] = log[-3000:]
    return res


def add_parser(sub, formatter) -> None:
    p = sub.add_parser(
        "locust",
        help="Locust drives the load; raw timings in HDR, merged into a distbench result",
        formatter_class=formatter,
        description=__doc__ + "\nExample: distbench locust --url http://127.0.0.1:8080 --users 8 "
        "--run-time 30 --workers 2 --save-result l.json",
    )
    p.add_argument("--url", required=True, help="server base URL, with or without a trailing /v1")
    p.add_argument("--users", type=int, default=8, help="concurrent Locust users (closed loop)")
    p.add_argument("--spawn-rate", type=float, default=8.0, help="users started per second")
    p.add_argument("--run-time", type=float, default=30.0, help="seconds")
    p.add_argument("--workers", type=int, default=0, help="0: one headless process; N: a master and N local workers")
    p.add_argument("--prompt-len", type=int, default=128, help="random prompt tokens")
    p.add_argument("--output-len", type=int, default=64, help="output tokens (ignore_eos)")
    p.add_argument("--slo", default=None, help="e.g. ttft:250ms,tpot:50ms")
    p.add_argument("--slo-target", type=float, default=0.9, help="SLO attainment needed to pass (fraction)")
    p.add_argument("--token", default=None, help="admin token (default $DISTSERVE_ADMIN_TOKEN)")
    p.add_argument(
        "--tokenizer", default=None, help="model folder whose vocabulary prompts use (default: ask the server)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    p.add_argument("--save-result", default=None, help="write the merged result JSON here")
    p.set_defaults(handler=cmd_locust)


def cmd_locust(args) -> int:
    from distserve.distbench.load_args import base
    from distserve.distbench.runner import admin_token
    from distserve.distbench.summary import format_summary

    if args.users < 1 or args.workers < 0 or args.run_time < 1 or args.prompt_len < 1 or args.output_len < 1:
        raise UsageError("--users, --run-time, --prompt-len, --output-len must be >= 1 and --workers >= 0")
    res = run_locust(
        base(args.url),
        args.users,
        args.spawn_rate,
        args.run_time,
        args.workers,
        args.prompt_len,
        args.output_len,
        args.slo,
        args.slo_target,
        admin_token(args.token),
        args.seed,
        args.tokenizer,
    )
    if args.save_result:
        print(f"saved {result.save(res, args.save_result)}")
    print(f"locust: {res['num_locust_processes']} process(es) with users")
    print(format_summary(res))
    return 0 if res["verdict"]["pass"] else 1
