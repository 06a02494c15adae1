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

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import yaml

from distserve.server.config import DistServeConfig
from distserve.server.memory_budget import device_key, plan_memory_shares, shared_devices
from distserve.server.mps import CONTEXT_MIB, MpsDaemon, device_sm_count
from distserve.server.preflight import launcher_tmp_prefix, sweep_orphan_segments, sweep_orphan_tmp
from distserve.server.private_files import write_private
from distserve.server.wire import DeregisterRequest

TOKEN_ENV = "DISTSERVE_ADMIN_TOKEN"


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


def plan_workers(
    mode: str, num_prefill: int, num_decode: int, device: str, devices: tuple[str, ...] = ()
) -> list[tuple[str, str, str]]:
    """(role, worker id, device) per worker, in start order: prefill workers first, then decode (or
    colocated) ones; ``devices`` are assigned round-robin in that order, else ``device`` to all."""
    roles = (
        ["prefill"] * num_prefill + ["decode"] * num_decode if mode == "disaggregated" else ["colocated"] * num_decode
    )
    return [(role, f"{role}-{i}", devices[i % len(devices)] if devices else device) for i, role in enumerate(roles)]


def device_total_mib(index: int) -> int | None:
    """The GPU's memory in MiB, read with nvidia-smi (the launcher never initialises CUDA itself)."""
    try:
        p = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", str(index)],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        return int(p.stdout.strip().splitlines()[0]) if p.returncode == 0 else None
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def mps_memory_limit_mib(role: str, share: float | None, total_mib: int | None, cfg: DistServeConfig) -> int | None:
    """``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` of one worker: its memory share plus the CUDA context, and for a
    decode (or colocated) worker the memory it maps from prefill workers too — MPS counts an opened CUDA
    IPC handle against the importer's limit (measured: at the share + 1 GiB, opening the prefill worker's
    2 GiB staging pool failed with out of memory), so the peer's staging pool and per-transfer exports
    (slack) are allowed on top. None: no limit (the share is unknown)."""
    if not share or not total_mib:
        return None
    if role == "prefill" and cfg.kv_transfer.by_reference != "off":
        return None  # it maps the decode worker's whole KV pool, which MPS would count against this limit
    limit = int(share * total_mib) + CONTEXT_MIB
    if role != "prefill":
        limit += cfg.kv_transfer.cuda_ipc_pool_mb + 4096
    return limit


class StartupRefused(RuntimeError):
    """A worker refused to start with a sentence saying why (exit 2): a bad configuration, not a crash."""


@dataclass(frozen=True)
class RestartPolicy:
    enabled: bool = True
    max_restarts: int = 5  # within window_s; one more exit is a crash loop
    window_s: float = 60.0
    backoff_s: float = 1.0  # first restart; doubles per restart inside the window
    max_backoff_s: float = 30.0

    def delay(self, recent: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2**recent)


PERMANENT_EXITS = {2: "bad usage or configuration", 3: "the router refused its registration"}


@dataclass
class RouterProbe:
    """The launcher's view of its router: when it last answered ``GET /health`` (any HTTP status)."""

    interval_s: float = 1.0
    timeout_s: float = 1.0
    frozen_after_s: float = 5.0
    # a router that answers nothing but keeps using CPU is busy, not frozen (a 2 000-client burst stalls its
    # loop for seconds): it is restarted only after this long without an answer
    busy_unanswered_s: float = 60.0
    last_ok: float = field(default_factory=time.monotonic)
    last_probe: float = 0.0
    last_progress: float = field(default_factory=time.monotonic)  # when its CPU time last moved
    cpu_s: float | None = None

    def due(self, now: float) -> bool:
        if now - self.last_probe < self.interval_s:
            return False
        self.last_probe = now
        return True

    def answered(self, url: str, now: float) -> bool:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=self.timeout_s):
                pass
        except urllib.error.HTTPError:
            pass  # 503 "down" is an answer: the router lives
        except (urllib.error.URLError, OSError):
            return False
        self.last_ok = now
        return True

    def progressed(self, pid: int, now: float) -> None:
        """Note the process's CPU time (``/proc``); where it moved since the last probe, it is running."""
        cpu = process_cpu_s(pid)
        if cpu is None or self.cpu_s is None or cpu > self.cpu_s:
            self.last_progress = now
        self.cpu_s = cpu

    def frozen(self, now: float) -> bool:
        """No answer for ``frozen_after_s`` and no CPU used for as long (SIGSTOP, a deadlock), or no answer
        for ``busy_unanswered_s`` whatever its CPU does."""
        silent = now - self.last_ok
        idle = now - max(self.last_progress, self.last_ok)
        return silent >= self.busy_unanswered_s or (silent >= self.frozen_after_s and idle >= self.frozen_after_s)

    def reset(self, now: float) -> None:
        self.last_ok = self.last_probe = self.last_progress = now
        self.cpu_s = None


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` so far (``/proc/PID/stat``), None where it cannot be read."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class _Worker:
    """One supervised worker: how to start it, its current process, its restart history."""

    worker_id: str
    argv: list[str]
    cpus: list[int] | None
    threads: int | None
    proc: subprocess.Popen
    env: dict[str, str] = field(default_factory=dict)  # its own variables (MPS client settings)
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
    memory_shares: dict[str, float] = field(default_factory=dict)  # worker id -> its share of its GPU
    mps: MpsDaemon | None = None  # the MPS control daemon of an SM split (prefill/decode.sm_share)
    mps_root: str | None = None  # where its private folder goes (default: the temp folder; tests)
    router_probe: RouterProbe = field(default_factory=lambda: RouterProbe())
    _router_argv: list[str] = field(default_factory=list)
    _router_threads: int | None = None

    def __post_init__(self) -> None:
        sweep_orphan_tmp()  # folders of launchers killed with SIGKILL
        sweep_orphan_segments()  # KV segments of prefill workers killed together with their tracker
        self._tmp = tempfile.TemporaryDirectory(prefix=launcher_tmp_prefix())
        self.config_path = Path(self._tmp.name) / "config.yaml"
        write_private(self.config_path, yaml.safe_dump(self.config.to_dict()))  # may carry the admin token

    def _spawn(
        self,
        argv: list[str],
        name: str,
        cpus: list[int] | None = None,
        threads: int | None = None,
        extra_env: dict[str, str] | None = None,
    ) -> subprocess.Popen:
        env = dict(os.environ)
        env.update(extra_env or {})
        env[TOKEN_ENV] = self.token
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        cmd = [sys.executable, "-m", "distserve.server.cli", *argv]
        out = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / f"{name}.log", "ab")
        p = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None, start_new_session=True
        )
        if out is not None:
            out.close()
        self.procs.append(p)
        return p

    def start(self, timeout_s: float = 180.0) -> str:
        ready = Path(self._tmp.name) / "router.json"
        argv = [
            "router",
            "--config",
            str(self.config_path),
            "--ready-file",
            str(ready),
            "--parent-pid",
            str(os.getpid()),
        ]
        if self.served_model_name:
            argv += ["--served-model-name", self.served_model_name]
        placement, threads = plan_cpus(self.mode, self.pinning)
        if placement.get("router"):
            argv += ["--cpus", ",".join(map(str, placement["router"]))]
        self._router_argv, self._router_threads = argv, threads["router"]
        deadline = time.monotonic() + timeout_s
        url = self._start_router(deadline)
        plan = plan_workers(self.mode, self.num_prefill, self.num_decode, self.device, self.devices)
        shares = plan_memory_shares(plan, self.config)
        shared = shared_devices(plan)
        self.memory_shares = shares
        sm_env = self._sm_split_env(plan, shares)  # starts the MPS daemon when a GPU is split
        for n, (role, worker_id, device) in enumerate(plan):
            cpus = placement.get(role)
            argv = [
                "worker",
                "--role",
                role,
                "--router",
                url,
                "--config",
                str(self.config_path),
                "--device",
                device,
                "--parent-pid",
                str(os.getpid()),
                "--worker-id",
                worker_id,
            ]
            if cpus:
                argv += ["--cpus", ",".join(map(str, cpus))]
            if worker_id in shares:
                argv += ["--gpu-memory-utilization", str(shares[worker_id])]
            if device_key(device) in shared and n > 0:
                # workers sharing a GPU size their memory one after another: each measures its own use,
                # not a neighbour's start-up (the worker registers after its last allocation)
                self.wait_healthy(n, deadline)
                deadline = time.monotonic() + timeout_s  # each such start gets the whole time
            env = sm_env.get(worker_id, {})
            proc = self._spawn(argv, worker_id, cpus, threads[role], env)
            self.supervised[worker_id] = _Worker(worker_id, argv, cpus, threads[role], proc, env)
        self.wait_healthy(len(plan), deadline)
        return url

    def _start_router(self, deadline: float, port: int | None = None) -> str:
        ready = Path(self._tmp.name) / "router.json"
        ready.unlink(missing_ok=True)
        argv = [*self._router_argv, *(["--port", str(port)] if port is not None else [])]
        router = self._spawn(argv, "router", threads=self._router_threads)
        self.procs.remove(router)
        self.procs.insert(0, router)  # procs[0] is the router; stop() ends it last
        while not ready.exists():
            if router.poll() is not None:
                raise RuntimeError(f"router exited with status {router.returncode} before it was ready")
            if time.monotonic() > deadline:
                raise RuntimeError("router did not start in time")
            time.sleep(0.05)
        url: str = json.loads(ready.read_text())["url"]
        self.url = url
        return url

    def supervise_router(self, now: float | None = None) -> str | None:
        """Probe the router's /health (at most every ``RouterProbe.interval_s``); a router that answers
        nothing for ``RouterProbe.frozen_after_s`` while its process lives is frozen (SIGSTOP, a
        deadlock): SIGKILL it and start a new one on the same port, so the workers (which retry their
        registration) and clients find it where it was. One sentence when it acted, else None."""
        now = time.monotonic() if now is None else now
        router = self.procs[0] if self.procs else None
        if router is None or self.url is None or not self.router_probe.due(now):
            return None
        if router.poll() is None and self.router_probe.answered(self.url, now):
            self.router_probe.progressed(router.pid, now)
            return None
        frozen = router.poll() is None
        if frozen:
            self.router_probe.progressed(router.pid, now)
        if frozen and not self.router_probe.frozen(now):
            return None
        silent = now - self.router_probe.last_ok
        why = (
            f"answered no health probe for {silent:.0f} s"
            + ("" if silent >= self.router_probe.busy_unanswered_s else " and used no CPU meanwhile")
            if frozen
            else f"exited with status {router.returncode}"
        )
        if frozen:
            router.kill()
        router.wait()
        self.procs.remove(router)
        port = int(self.url.rsplit(":", 1)[1])
        self._start_router(time.monotonic() + 60.0, port=port)
        self.router_probe.reset(time.monotonic())
        return f"router {why}; restarted on the same port (pid {self.procs[0].pid})"

    def _sm_split_env(self, plan: list[tuple[str, str, str]], shares: dict[str, float]) -> dict[str, dict[str, str]]:
        """{worker id: MPS client variables} for the workers of a GPU split by ``sm_share`` (started here:
        the MPS daemon, once). Empty when no role has a share or no worker is on a GPU."""
        pct = {"prefill": self.config.prefill.sm_share}
        pct["decode"] = pct["colocated"] = self.config.decode.sm_share
        split = [(r, w, d) for r, w, d in plan if device_key(d) is not None and pct[r] > 0]
        if not split:
            return {}
        self.mps = MpsDaemon(root=self.mps_root).start()
        for event in self.mps.events:
            print(f"distserve: {event}", file=sys.stderr, flush=True)
        out = {}
        sm_totals: dict[int, int | None] = {}
        for role, worker_id, device in split:
            index = int(str(device_key(device)).split(":")[1])
            if index not in sm_totals:
                sm_totals[index] = device_sm_count(index)
            total = device_total_mib(index)
            limit = mps_memory_limit_mib(role, shares.get(worker_id), total, self.config)
            env = self.mps.env(pct[role], limit, index)
            if total:
                env["DISTSERVE_DEVICE_TOTAL_MIB"] = str(total)  # its share is of the whole device, not the limit
            if sm_totals[index]:
                env["DISTSERVE_DEVICE_SM_COUNT"] = str(sm_totals[index])  # for the worker's start-up probe
            out[worker_id] = env
        return out

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
                w.proc = self._spawn(
                    [*w.argv, "--restart-count", str(len(w.restarts))], w.worker_id, w.cpus, w.threads, w.env
                )
                events.append(f"worker {w.worker_id} restarted (pid {w.proc.pid}, restart {len(w.restarts)})")
        return events

    def _on_exit(self, w: _Worker, now: float) -> str:
        rc = w.proc.returncode
        status = f"killed by signal {-rc}" if rc < 0 else f"exited with status {rc}"
        recent = [t for t in w.restarts if now - t <= self.restart.window_s]
        if rc in PERMANENT_EXITS or not self.restart.enabled or len(recent) >= self.restart.max_restarts:
            w.given_up = True
            why = (
                PERMANENT_EXITS[rc]
                if rc in PERMANENT_EXITS
                else "restarts are off"
                if not self.restart.enabled
                else f"crash loop: {len(recent) + 1} exits within {self.restart.window_s:g} s"
            )
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
        req = urllib.request.Request(
            f"{self.url}/deregister",
            data=body,
            method="POST",
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"},
        )
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
                    args = [str(a) for a in cast(list, p.args)]
                    # the worker's name (prefill-0), else the subcommand (router)
                    what = args[args.index("--worker-id") + 1] if "--worker-id" in args[:-1] else " ".join(args[3:4])
                    why = (
                        " (SIGKILL: most likely the kernel's out-of-memory killer; see `dmesg`)"
                        if p.returncode == -9
                        else f" (killed by signal {-p.returncode})"
                        if p.returncode < 0
                        else ""
                    )
                    said = self._refusal(what) if p.returncode == 2 else None
                    if said:  # it refused to start (e.g. its memory share cannot hold the model): its sentence
                        raise StartupRefused(said)
                    raise RuntimeError(
                        f"process {p.pid} ({what}) exited with status {p.returncode} during start-up{why}"
                    )
            try:
                ws = self.workers()["workers"]
                if sum(w["healthy"] for w in ws) >= expected:
                    return
            except (urllib.error.URLError, OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"workers not healthy in time ({expected} expected)")
            time.sleep(0.1)

    def _refusal(self, name: str) -> str | None:
        """The sentence a child that exited 2 printed last ("distserve worker: error: ..."), from its log file;
        None without a log folder (its output went to this process's own) or when it printed none."""
        if self.log_dir is None:
            return None
        try:
            lines = (self.log_dir / f"{name}.log").read_text(errors="replace").splitlines()
        except OSError:
            return None
        said = [ln.split(": error: ", 1)[1] for ln in lines if ln.startswith("distserve worker: error: ")]
        return said[-1].strip() if said else None

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
        if self.mps is not None:  # after its clients exited
            self.mps.stop()
            self.mps = None
        self._tmp.cleanup()
