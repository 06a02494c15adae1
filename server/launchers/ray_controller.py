"""The deployment's controller: a named Ray actor that owns the router and the workers.

``distserve serve --launcher ray`` creates it (named ``ray.deployment`` in ``ray.namespace``) on its own
node and waits on it; ``distserve scale`` finds it by name. It keeps the layout asked for:

- **start**: the router's actor, then every worker's actor, each placed by its pool's resources; it
  returns once every worker has registered with the router;
- **supervise**: a worker whose process exits, or whose actor is lost with its node, is reported dead
  to the router at once (its streams migrate, it gets no new request) and started again under the same
  id after the local launcher's backoff (``RestartPolicy``) — on whatever node offers its resources,
  waiting for one if none does;
- **scale**: grows a pool by new worker ids, shrinks it by draining (``drain.py``) the newest workers:
  no new request, requests in flight finish (or migrate past ``ray.drain_timeout_s``), KV freed, then the
  process deregisters and exits and the actor's resources are released.

Every worker actor is owned by this actor and every process watches its actor, so when the controller
goes (the ``serve`` process ended or was killed) everything it started goes too.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import ray
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from distserve.server.launcher import PERMANENT_EXITS, TOKEN_ENV, RestartPolicy
from distserve.server.launchers.drain import drain_worker
from distserve.server.launchers.ray_actors import remote_process_actor
from distserve.server.launchers.ray_placement import RaySpec, actor_options, torch_threads

LOG_LEVEL_ENV = "DISTSERVE_LOG_LEVEL"
_LIVE = ("pending", "starting", "running", "restarting")  # counted in a pool's size
_RETIRE_ORDER = {"pending": 0, "restarting": 1, "starting": 2, "running": 3}  # not serving yet goes first


@dataclass
class _Member:
    worker_id: str
    role: str
    index: int
    state: str = "pending"  # pending (no node yet) | starting | running | restarting | draining | stopping | failed
    actor: Any = None
    where: dict | None = None  # pid, node_ip, node_id, actor_pid
    restart_count: int = 0
    restarts: list[float] = field(default_factory=list)
    registered: asyncio.Event = field(default_factory=asyncio.Event)
    launched_at: float = 0.0
    join_s: float | None = None  # from launch to registered with the router

    def to_dict(self) -> dict:
        w = self.where or {}
        return {
            "worker_id": self.worker_id,
            "role": self.role,
            "state": self.state,
            "node_ip": w.get("node_ip"),
            "node_id": w.get("node_id"),
            "pid": w.get("pid"),
            "restart_count": self.restart_count,
            "start_to_registered_s": None if self.join_s is None else round(self.join_s, 3),
        }


class DeploymentController:
    def __init__(self, spec: RaySpec) -> None:
        self.spec = spec
        self.actor_cls = remote_process_actor()
        self.members: dict[str, _Member] = {}
        self.url: str | None = None
        self.router: Any = None
        self.router_exit: Any = None
        self.router_rc: int | None = None
        self.lock = asyncio.Lock()
        self.log: collections.deque[tuple[int, str]] = collections.deque(maxlen=2000)
        self.seq = 0
        self.next_index: dict[str, int] = collections.defaultdict(int)
        self.policy = RestartPolicy(
            enabled=spec.restart, max_restarts=spec.max_restarts, window_s=spec.restart_window_s
        )
        self.tasks: set[asyncio.Task] = set()
        self.env = {TOKEN_ENV: spec.token, LOG_LEVEL_ENV: spec.log_level}

    # --- public methods (Ray calls) ----------------------------------------------------------------------
    async def start(self) -> str:
        """Router, then every worker; the router's URL once all have registered (RuntimeError otherwise)."""
        s = self.spec
        opts = actor_options(s.router_resources, 1.0, False)
        if not s.router_resources and s.driver_node_id:
            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(s.driver_node_id, soft=False)
        self.router = self.actor_cls.options(**opts).remote()
        argv = [
            "router",
            "--config",
            "{config}",
            "--ready-file",
            "{ready_file}",
            "--host",
            s.router_host,
            "--port",
            str(s.router_port),
        ]
        if s.served_model_name:
            argv += ["--served-model-name", s.served_model_name]
        await self.router.start.remote(argv, {**self.env, "OMP_NUM_THREADS": "1"}, s.config_yaml)
        self.url = (await self.router.ready.remote(s.start_timeout_s))["url"]
        self.router_exit = self.router.wait_exit.remote()
        self._spawn(self._watch_router())
        self._event(f"router listening on {self.url}")
        sizes = (
            {"prefill": s.num_prefill, "decode": s.num_decode}
            if s.mode == "disaggregated"
            else {"colocated": s.num_decode}
        )
        report = await self._grow(sizes)
        if report["pending"]:
            raise RuntimeError(self._not_placed(report["pending"]))
        return self.url

    async def scale(self, prefill: int | None, decode: int | None) -> dict:
        """Grow or shrink the pools (None: leave that pool as it is); a report of who joined and who left."""
        async with self.lock:
            t0 = time.monotonic()
            targets = (
                {"prefill": prefill, "decode": decode} if self.spec.mode == "disaggregated" else {"colocated": decode}
            )
            grow, shrink = {}, []
            for role, n in targets.items():
                if n is None:
                    continue
                live = [m for m in self.members.values() if m.role == role and m.state in _LIVE]
                if n > len(live):
                    grow[role] = n - len(live)
                else:
                    live.sort(key=lambda m: (_RETIRE_ORDER[m.state], -m.index))
                    shrink += live[: len(live) - n]
            left_task = asyncio.gather(*(self._retire(m) for m in shrink))
            report = await self._grow(grow)
            report["left"] = list(await left_task)
            report["seconds"] = round(time.monotonic() - t0, 3)
            report["layout"] = self.layout()
            return report

    def layout(self) -> dict[str, int]:
        out: dict[str, int] = collections.Counter()
        for m in self.members.values():
            if m.state in _LIVE:
                out[m.role] += 1
        return dict(out)

    async def status(self) -> dict:
        return {
            "deployment": self.spec.deployment,
            "mode": self.spec.mode,
            "router_url": self.url,
            "router_exit_status": self.router_rc,
            "layout": self.layout(),
            "workers": [m.to_dict() for m in sorted(self.members.values(), key=lambda m: m.worker_id)],
        }

    async def events(self, since: int) -> list[tuple[int, str]]:
        return [e for e in self.log if e[0] > since]

    async def shutdown(self) -> None:
        """Every worker (SIGTERM: they deregister), then the router; their actors released."""
        members = list(self.members.values())
        for m in members:
            m.state = "stopping"
        await asyncio.gather(*(self._stop_actor(m.actor) for m in members if m.actor is not None))
        if self.router is not None:
            await self._stop_actor(self.router)
        for t in list(self.tasks):
            t.cancel()

    # --- growing -----------------------------------------------------------------------------------------
    async def _grow(self, counts: dict[str, int]) -> dict:
        new = []
        for role, n in counts.items():
            for _ in range(n):
                index = self.next_index[role]
                self.next_index[role] += 1
                m = _Member(f"{role}-{index}", role, index)
                self.members[m.worker_id] = m
                new.append(m)
                self._spawn(self._launch(m))
        waits = [asyncio.wait_for(m.registered.wait(), self.spec.start_timeout_s) for m in new]
        done = await asyncio.gather(*waits, return_exceptions=True)
        joined = [m.to_dict() for m, d in zip(new, done) if d is True]
        pending = [m.to_dict() for m, d in zip(new, done) if d is not True]
        return {"joined": joined, "pending": pending}

    async def _launch(self, m: _Member) -> None:
        s = self.spec
        res = s.pool_resources(m.role)
        m.actor = self.actor_cls.options(**actor_options(res, 1.0, s.device.startswith("cuda"))).remote()
        m.state, m.launched_at, m.where = "pending", time.monotonic(), None
        m.registered.clear()
        argv = [
            "worker",
            "--role",
            m.role,
            "--router",
            self.url,
            "--config",
            "{config}",
            "--device",
            s.device,
            "--host",
            "{node_ip}",
            "--worker-id",
            m.worker_id,
            "--restart-count",
            str(m.restart_count),
        ]
        env = {**self.env, "OMP_NUM_THREADS": str(torch_threads(res, 1.0))}
        try:
            m.where = await m.actor.start.remote(argv, env, s.config_yaml)  # waits for a node with the resources
        except RayActorError as e:
            if m.state == "pending":
                await self._on_lost(m, None, f"was lost with its Ray actor before it started ({type(e).__name__})")
            return
        if m.state != "pending":  # retired while it waited for a node
            return
        m.state = "starting"
        self._event(f"worker {m.worker_id} placed on node {m.where['node_ip']} (pid {m.where['pid']})")
        self._spawn(self._watch(m, m.actor.wait_exit.remote()))
        self._spawn(self._await_registration(m))

    async def _await_registration(self, m: _Member) -> None:
        headers = {"Authorization": f"Bearer {self.spec.token}"}
        pid = m.where["pid"] if m.where else None
        async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=5)) as http:
            while m.state == "starting":
                try:
                    async with http.get(f"{self.url}/v1/workers") as r:
                        workers = (await r.json())["workers"] if r.status == 200 else []
                except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
                    workers = []
                if any(w["worker_id"] == m.worker_id and w["pid"] == pid and w["healthy"] for w in workers):
                    m.state, m.join_s = "running", time.monotonic() - m.launched_at
                    m.registered.set()
                    self._event(f"worker {m.worker_id} registered ({m.join_s:.1f} s after launch)")
                    return
                await asyncio.sleep(0.05)

    # --- supervision -------------------------------------------------------------------------------------
    async def _watch(self, m: _Member, exit_ref: Any) -> None:
        try:
            rc: int | None = await exit_ref
            why = f"killed by signal {-rc}" if rc is not None and rc < 0 else f"exited with status {rc}"
        except RayActorError as e:
            rc, why = None, f"lost with its Ray actor ({type(e).__name__}: its node died or the actor was killed)"
        if m.state in ("draining", "stopping"):
            return
        await self._on_lost(m, rc, why)

    async def _on_lost(self, m: _Member, rc: int | None, why: str) -> None:
        self._kill(m.actor)
        now = time.monotonic()
        recent = [t for t in m.restarts if now - t <= self.policy.window_s]
        if rc in PERMANENT_EXITS or not self.policy.enabled or len(recent) >= self.policy.max_restarts:
            m.state = "failed"
            reason = (
                PERMANENT_EXITS[rc]
                if rc in PERMANENT_EXITS
                else "restarts are off"
                if not self.policy.enabled
                else "crash loop"
            )
            await self._report_dead(m.worker_id, f"{why}; not restarted: {reason}")
            self._event(f"worker {m.worker_id} {why}; not restarting it ({reason})")
            return
        delay = self.policy.delay(len(recent))
        m.state = "restarting"
        await self._report_dead(m.worker_id, f"{why}; restarting")
        self._event(f"worker {m.worker_id} {why}; starting a replacement in {delay:.1f} s")
        await asyncio.sleep(delay)
        if m.state != "restarting":  # retired meanwhile
            return
        m.restarts.append(time.monotonic())
        m.restart_count += 1
        await self._launch(m)

    async def _watch_router(self) -> None:
        try:
            self.router_rc = await self.router_exit
        except RayActorError:
            self.router_rc = -1
        self._event(f"router exited (status {self.router_rc})")

    async def _report_dead(self, worker_id: str, reason: str) -> None:
        """Out of rotation now, every wait on it failed (its streams migrate), before Ray notices anything."""
        headers = {"Authorization": f"Bearer {self.spec.token}"}
        try:
            async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=2)) as http:
                async with http.post(f"{self.url}/deregister", json={"worker_id": worker_id, "reason": reason[:256]}):
                    pass
        except (aiohttp.ClientError, TimeoutError, OSError):
            pass  # the router's own checks (refused connections, missed heartbeats) catch it

    # --- shrinking ---------------------------------------------------------------------------------------
    async def _retire(self, m: _Member) -> dict:
        before, m.state = m.state, "draining"
        if before in ("pending", "restarting") or m.where is None:
            self._kill(m.actor)
            self.members.pop(m.worker_id, None)
            self._event(f"worker {m.worker_id} cancelled before it served ({before})")
            return {"worker_id": m.worker_id, "idle": True, "detail": f"cancelled while {before}"}
        self._event(f"worker {m.worker_id} draining")
        assert self.url is not None  # workers exist only after the router started
        result = (await drain_worker(self.url, self.spec.token, m.worker_id, self.spec.drain_timeout_s)).to_dict()
        m.state = "stopping"
        result["exit_status"] = await self._stop_actor(m.actor)
        self.members.pop(m.worker_id, None)
        self._event(f"worker {m.worker_id} left after {result['seconds']:.1f} s ({result['detail']})")
        return result

    async def _stop_actor(self, actor: Any) -> int | None:
        try:
            rc = await actor.stop.remote(10.0)
        except RayActorError:
            rc = None
        self._kill(actor)
        return rc

    # --- helpers -----------------------------------------------------------------------------------------
    def _kill(self, actor: Any) -> None:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # already gone  # noqa: BLE001
            pass

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _event(self, text: str) -> None:
        self.seq += 1
        self.log.append((self.seq, text))

    def _not_placed(self, pending: list[dict]) -> str:
        names = ", ".join(p["worker_id"] for p in pending)
        asks = {r: dict(self.spec.pool_resources(r)) for r in {p["role"] for p in pending}}
        return (
            f"workers {names} did not register within {self.spec.start_timeout_s:g} s; they ask for {asks} "
            f"(plus CPU 1 unless given); the cluster offers {ray.cluster_resources()}"
        )


def remote_controller():
    return ray.remote(num_cpus=0, max_restarts=0)(DeploymentController)
