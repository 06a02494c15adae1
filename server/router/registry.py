"""The router's view of its workers: who exists, who is healthy, who is least loaded.

Workers push heartbeats carrying their load. Each worker is in one state:

- ``healthy``: in rotation;
- ``stale``: no heartbeat for ``heartbeat_timeout`` (frozen, or gone silently); out of rotation
  until the next heartbeat, forgotten after ``forget_after``;
- ``suspect``: a call to it just failed (HTTP error, broken stream); out of rotation until its next
  heartbeat;
- ``dead``: its process is gone (connection refused, or the launcher saw it exit); out of rotation
  until it registers again. Its load numbers are no longer reported (``kv_blocks_used: null``), so a
  leak check never reads a dead worker's last heartbeat as live;
- ``draining``: leaving on purpose (``POST /drain``, a scale-down): never picked for a new request, its
  requests in flight continue; heartbeats keep it draining. It leaves the registry when it deregisters.

Every wait on a worker (a prefill answer, the next line of a token stream) is registered with it
(:meth:`WorkerInfo.watch`). When the worker is dead, those waits fail at once; when it has been
silent for ``fail_waits_after`` (the router's stream progress deadline), they fail too — a frozen
process, not a slow step: a long engine step also delays heartbeats, which should only take the
worker out of rotation, not cut its streams. Their requests then migrate instead of waiting out
the request timeout. Every worker must share one
model fingerprint: KV from one prefill worker has to be readable by any decode worker.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

from distserve.server.config import OutlierConfig, RouterConfig
from distserve.server.router.outlier import OutlierDetector
from distserve.server.router.prefix_index import PrefixIndex
from distserve.server.wire import RegisterRequest, WorkerStatus

HEALTHY, STALE, SUSPECT, DEAD, DRAINING = "healthy", "stale", "suspect", "dead", "draining"
STATES = (HEALTHY, STALE, SUSPECT, DEAD, DRAINING)

log = logging.getLogger(__name__)


def transition(info: WorkerInfo, new: str, reason: str) -> None:
    """Move ``info`` to state ``new`` and write the one operator line of that transition (with its reason
    and figure: "no heartbeat for 3.1 s"). No line when the state does not change."""
    old = info.state
    info.state = new
    if old == new:
        return
    now = time.monotonic()
    if new == HEALTHY:
        log.info(
            "worker %s (%s) healthy again after %.1f s %s: %s",
            info.worker_id,
            info.role,
            now - info.state_since,
            old,
            reason,
        )
    else:
        level = logging.INFO if new == DRAINING else logging.WARNING
        log.log(level, "worker %s (%s) %s (was %s): %s", info.worker_id, info.role, new, old, reason)
    info.state_since = now


class Waiter(Protocol):
    def expire(self, reason: str) -> None: ...


class RegistrationRefused(Exception):
    pass


@dataclass
class WorkerInfo:
    worker_id: str
    role: str
    url: str
    pid: int
    fingerprint: dict
    model_path: str | None
    max_model_len: int
    host_id: str
    status: WorkerStatus
    cuda_uuids: list[str] = field(default_factory=list)  # GPUs it can open IPC handles of
    kv_arena: str = ""  # its KV lessor's host:port when it takes KV by reference
    restart_count: int = 0  # times the launcher restarted this worker id
    memory: dict | None = None  # its device-memory sizing (GPU workers)
    prefill_warmup: dict | None = None  # its start-up prefill, timed: {tokens, requests, ms} (the TTFT prior)
    decode_warmup: dict | None = None  # its start-up decode steps, timed: {batch, steps, ms per step} (room prior)
    last_seen: float = field(default_factory=time.monotonic)
    lag_at_seen: float = 0.0  # the router's loop lag total (``WorkerRegistry.lag_s``) at ``last_seen``
    # its last heartbeat came through the control plane (server/router/control.py): ``last_seen`` is when the
    # control thread read it, so the main loop's lag says nothing about its age
    direct: bool = False
    registered_at: float = field(default_factory=time.time)
    state: str = HEALTHY
    state_since: float = field(default_factory=time.monotonic)  # when it entered `state` (transition logs)
    dead_reason: str | None = None
    inflight: int = 0  # requests routed here and not finished, counted from the moment of the pick
    joined_at: float = field(default_factory=time.monotonic)  # when this process registered
    first_pick_at: float | None = None  # when the router first routed a request to it
    last_pick_at: float = 0.0  # when it was last picked (0: never): breaks ties between equal loads
    waiters: set = field(default_factory=set)  # Waiter objects of calls in flight to this worker
    latency: deque = field(default_factory=deque)  # (monotonic time, seconds): TTFT or TPOT (outlier.py)
    ejected_until: float = 0.0  # monotonic; 0: not ejected (outlier.py)
    ejections: int = 0  # consecutive ejections (the cooling period's multiplier)
    prefix_hits: int = 0  # requests routed here for a prefix this worker's summary said it held
    progress_at: float = field(default_factory=time.monotonic)  # when its engine step count last moved

    def progressing(self, now: float, within_s: float) -> bool:
        """Its engine is working through its queue: its last heartbeat says a step is running, or its step
        count moved within ``within_s``. A heartbeat that falls between two steps of a busy worker says
        ``in_step: false``; the moving count still shows it busy, not hung."""
        return self.status.in_step or now - self.progress_at < within_s

    @property
    def healthy(self) -> bool:
        return self.state == HEALTHY

    @contextmanager
    def watch(self, waiter: Waiter) -> Iterator[None]:
        """Register a wait on this worker for the duration of the block (see the module docstring)."""
        if self.state == DEAD:
            waiter.expire(f"{self.role} worker {self.worker_id} is dead")
        self.waiters.add(waiter)
        try:
            yield
        finally:
            self.waiters.discard(waiter)

    def expire_waiters(self) -> None:
        if not self.waiters:
            return
        reason = (
            f"{self.role} worker {self.worker_id} is dead ({self.dead_reason})"
            if self.state == DEAD
            else f"{self.role} worker {self.worker_id} sent no heartbeat for {time.monotonic() - self.last_seen:.1f} s"
        )
        for w in list(self.waiters):
            w.expire(reason)

    def load(self) -> float:
        """Lower is better: router-side in-flight work, the worker's queues, and KV pressure."""
        s = self.status
        total = s.kv_blocks_used + s.kv_blocks_free
        kv_pressure = s.kv_blocks_used / total if total else 0.0
        return self.inflight + s.num_waiting + s.num_reserving + 4.0 * kv_pressure

    def to_dict(self, now: float) -> dict:
        live = self.state != DEAD  # a dead worker's last heartbeat says nothing about now
        s = self.status
        return {
            "worker_id": self.worker_id,
            "role": self.role,
            "pid": self.pid,
            "url": self.url,
            "healthy": self.healthy,
            "state": self.state,
            "dead_reason": self.dead_reason,
            "last_heartbeat_s_ago": round(now - self.last_seen, 3),
            "restart_count": self.restart_count,
            "queue_depth": s.num_waiting + s.num_reserving if live else None,
            "num_running": s.num_running if live else None,
            "inflight": self.inflight,
            "kv_blocks_used": s.kv_blocks_used if live else None,
            "kv_blocks_free": s.kv_blocks_free if live else None,
            "num_staged_kv": s.num_staged_kv if live else None,
            "memory_errors_recent": s.memory_errors_recent if live else None,
            "memory": self.memory,
            "prefill_warmup": self.prefill_warmup,
            "decode_warmup": self.decode_warmup,
            "fingerprint": self.fingerprint,
            "model_path": self.model_path,
            "max_model_len": self.max_model_len,
            "ejected": bool(self.ejected_until),
            "ejected_for_s": round(max(0.0, self.ejected_until - now), 3) if self.ejected_until else None,
            "recent_latency_samples": len(self.latency),
            "prefix_routed_hits": self.prefix_hits,
            "join_to_first_request_ms": (
                round((self.first_pick_at - self.joined_at) * 1000, 3) if self.first_pick_at is not None else None
            ),
        }


class WorkerRegistry:
    """The workers, and how a request picks one.

    Cost model of ``pick`` (lower wins)::

        score(w) = load(w) + prefix_cache_weight x (1 - cached_tokens(w) / prompt_tokens)

    ``load`` counts requests (in flight from here, queued there) plus KV pressure; ``cached_tokens`` is
    the expected prefix-cache hit there (``PrefixIndex.expected_hits`` x block size). So a worker holding the
    whole prompt wins over one holding none unless it carries ``prefix_cache_weight`` more requests of load:
    a cache hit saves a prefill's compute, which is worth about that many requests queued ahead of it. With
    no (fresh) summary, or weight 0, every worker's second term is the same: the least-load pick."""

    def __init__(
        self,
        heartbeat_timeout_s: float,
        forget_after_s: float | None = None,
        fail_waits_after_s: float = 10.0,
        *,
        prefix_cache_weight: float = 2.0,
        prefix_summary_max_age_s: float = 10.0,
        outlier: OutlierConfig | None = None,
    ) -> None:
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.forget_after_s = forget_after_s if forget_after_s is not None else 20 * heartbeat_timeout_s
        self.fail_waits_after_s = max(heartbeat_timeout_s, fail_waits_after_s)
        self.workers: dict[str, WorkerInfo] = {}
        self.prefix = PrefixIndex(max_age_s=prefix_summary_max_age_s)
        self.prefix_cache_weight = prefix_cache_weight
        self.last_pick_cached_tokens = 0  # of the latest pick (read by the pipeline right after it)
        self.outliers = OutlierDetector(outlier if outlier is not None else OutlierConfig())
        # The router's own pulse (``tick``, from its sweeper task): when its event loop stalled (a CPU taken by
        # neighbours), the heartbeats sent meanwhile wait unread in their sockets; judging workers by them
        # right after the stall would make every healthy worker look stale at once (and every request 503).
        self._ticked_at: float | None = None  # None: no sweeper ticks (unit tests): no stall correction
        # Below a stall the loop can still run behind all the time (thousands of clients on a few cores):
        # the sweeper adds how late each of its sleeps woke, and a heartbeat's age leaves out the lag
        # accumulated since it was read (the heartbeats sent meanwhile wait behind the same backlog).
        self.lag_s = 0.0
        self._grace_from = 0.0  # heartbeat ages count from here at the earliest (the end of a router stall)
        # Heartbeats read by the control-plane thread (server/router/control.py) wait here, with the time that
        # thread read them, until the main loop applies them (every ``sweep``): the registry itself is only
        # touched by the main loop. The control thread has its own pulse: when it stalled (the whole process
        # stopped), ages of direct heartbeats count from its recovery, as ``_grace_from`` does for the loop.
        self._inbox: dict[str, tuple[WorkerStatus, float, float | None]] = {}
        self._inbox_lock = threading.Lock()
        self._ctl_ticked_at: float | None = None
        self._ctl_grace_from = 0.0

    def configure(self, rc: RouterConfig, on_eject: Callable[[str], None] | None = None) -> None:
        """Take the router section's routing settings (cache-aware weight, summary age, outlier ejection)."""
        self.prefix_cache_weight = rc.prefix_cache_weight
        self.prefix.max_age_s = rc.prefix_summary_max_age_s
        self.outliers = OutlierDetector(rc.outlier, on_eject)

    def register(self, req: RegisterRequest) -> WorkerInfo:
        self.sweep()
        for other in self.workers.values():
            if other.state == DEAD:
                continue
            if other.worker_id != req.worker_id and other.fingerprint != req.fingerprint:
                diff = sorted(
                    k
                    for k in set(other.fingerprint) | set(req.fingerprint)
                    if other.fingerprint.get(k) != req.fingerprint.get(k)
                )
                raise RegistrationRefused(
                    f"model fingerprint mismatch with {other.role} worker {other.worker_id}: "
                    + ", ".join(
                        f"{k}={req.fingerprint.get(k)!r} (registered: {other.fingerprint.get(k)!r})" for k in diff
                    )
                    + "; every prefill and decode worker must serve the same model, dtype and KV layout"
                )
        info = WorkerInfo(
            worker_id=req.worker_id,
            role=req.role,
            url=req.url.rstrip("/"),
            pid=req.pid,
            fingerprint=req.fingerprint,
            model_path=req.model_path,
            max_model_len=req.max_model_len,
            host_id=req.host_id,
            status=req.status,
            cuda_uuids=list(req.cuda_uuids),
            kv_arena=req.kv_arena,
            restart_count=req.restart_count,
            memory=req.memory,
            prefill_warmup=req.prefill_warmup.model_dump() if req.prefill_warmup is not None else None,
            decode_warmup=req.decode_warmup.model_dump() if req.decode_warmup is not None else None,
        )
        old = self.workers.get(req.worker_id)
        if old is not None:
            if old.state == DEAD or old.pid != req.pid:  # a new process under the old id: the old one's
                old.dead_reason = old.dead_reason or "replaced"  # calls cannot succeed
                transition(old, DEAD, f"replaced by pid {req.pid}")
                old.expire_waiters()
            else:
                info.inflight, info.waiters = old.inflight, old.waiters
                info.joined_at, info.first_pick_at = old.joined_at, old.first_pick_at
                info.last_pick_at = old.last_pick_at
                if old.state == DRAINING:  # the same process registering again (router restarted) still leaves
                    info.state = DRAINING
                elif old.state != HEALTHY:
                    info.state, info.state_since = old.state, old.state_since
                    transition(info, HEALTHY, "registered again")
        self.workers[req.worker_id] = info
        if old is not None and old.pid != req.pid:
            self.prefix.drop(req.worker_id)  # a new process: the old one's cache is gone with it
        self.prefix.update(req.worker_id, req.status)
        return info

    def heartbeat(self, worker_id: str, status: WorkerStatus) -> bool:
        """A heartbeat read on the main loop (``POST /heartbeat`` on the router's port)."""
        info = self.workers.get(worker_id)
        if info is None or info.state == DEAD:
            return False  # a dead worker that still heartbeats must register again
        now = time.monotonic()
        progressed = now if status.num_steps != info.status.num_steps or status.in_step else None
        self._apply(info, status, now, progressed, direct=False)
        return True

    def knows(self, worker_id: str) -> bool:
        """Whether ``worker_id`` is registered and not dead (safe from the control thread: one dict read)."""
        info = self.workers.get(worker_id)
        return info is not None and info.state != DEAD

    def receive(self, worker_id: str, status: WorkerStatus, at: float, progressed_at: float | None) -> None:
        """From the control thread: a heartbeat read at ``at`` (monotonic); applied by the next ``sweep``.
        ``progressed_at``: ``at`` when that thread saw the worker's step count move or a step running."""
        with self._inbox_lock:
            prev = self._inbox.get(worker_id)
            if progressed_at is None and prev is not None:
                progressed_at = prev[2]  # an earlier heartbeat not applied yet showed progress
            self._inbox[worker_id] = (status, at, progressed_at)

    def main_loop_ticked_within(self, seconds: float) -> bool:
        """Whether the main loop's sweeper ran within ``seconds`` (True before its first tick)."""
        t = self._ticked_at
        return t is None or time.monotonic() - t < seconds

    def control_tick(self) -> None:
        """The control thread's pulse (``ControlPlane``): it reads heartbeats as they come."""
        self._ctl_ticked_at = time.monotonic()

    def apply_received(self) -> None:
        """Apply the heartbeats the control thread read (main loop only)."""
        if not self._inbox:
            return
        with self._inbox_lock:
            got, self._inbox = self._inbox, {}
        for worker_id, (status, at, progressed) in got.items():
            info = self.workers.get(worker_id)
            if info is None or info.state == DEAD or at < info.last_seen:
                continue  # deregistered, dead or replaced since; or older than what the main port took
            self._apply(info, status, at, progressed, direct=True)

    def _apply(self, info: WorkerInfo, status: WorkerStatus, at: float, progressed: float | None, direct: bool) -> None:
        if progressed is not None:
            info.progress_at = max(info.progress_at, progressed)
        info.status = status
        self.prefix.update(info.worker_id, status, at)
        gap = at - info.last_seen
        info.last_seen, info.lag_at_seen, info.direct = at, self.lag_s, direct
        if info.state != DRAINING and info.state != HEALTHY:
            transition(info, HEALTHY, f"heartbeat after {gap:.1f} s")

    def deregister(self, worker_id: str, pid: int | None = None) -> bool:
        """A worker leaving on purpose (drain, shutdown): forget it. Its calls in flight finish.

        With ``pid``, only that process's entry: the late goodbye of a replaced process must not
        remove the replacement registered under the same id."""
        info = self.workers.get(worker_id)
        if info is None or (pid is not None and info.pid != pid):
            return False
        del self.workers[worker_id]
        self.prefix.drop(worker_id)
        return True

    def drain(self, worker_id: str) -> bool:
        """Take a worker out of rotation for good (scale-down); its requests in flight continue."""
        info = self.workers.get(worker_id)
        if info is None or info.state == DEAD:
            return False
        transition(info, DRAINING, "drain requested: out of rotation, its requests in flight continue")
        return True

    def mark_dead(self, worker_id: str, reason: str) -> bool:
        """Its process is gone: out of rotation, every wait on it fails now, load no longer reported."""
        info = self.workers.get(worker_id)
        if info is None:
            return False
        info.dead_reason = reason
        transition(info, DEAD, reason)
        self.prefix.drop(worker_id)
        info.expire_waiters()
        return True

    def mark_suspect(self, worker_id: str, reason: str = "a call to it failed") -> None:
        """Take a worker out of rotation after a failed call; its next heartbeat restores it."""
        info = self.workers.get(worker_id)
        if info is not None and info.state == HEALTHY:
            transition(info, SUSPECT, reason)

    def silent_for(self, info: WorkerInfo, now: float) -> float:
        """How long ``info`` has been silent as far as its heartbeats tell (from the end of a router stall).

        A heartbeat the control thread read carries its true time of arrival: only a stall of that thread
        (the whole process stopped) is left out, not the main loop's lag."""
        if info.direct:
            return max(0.0, now - max(info.last_seen, self._ctl_grace_from))
        lag = self.lag_s - info.lag_at_seen if info.last_seen >= self._grace_from else 0.0
        return max(0.0, now - max(info.last_seen, self._grace_from) - lag)

    def tick(self, late_s: float = 0.0) -> None:
        """The router's sweeper ran (every heartbeat timeout / 2 or sooner): its event loop is not stalled;
        ``late_s``: how much later than asked its sleep woke (the loop's lag, added to ``lag_s``)."""
        self._ticked_at = time.monotonic()
        self.lag_s += max(0.0, late_s)

    def sweep(self) -> None:
        """Age the states; fail the waits on workers silent for ``fail_waits_after_s`` (frozen).

        A heartbeat's age counts from the end of the router's own latest stall at the earliest: a router
        whose loop did not run for over half a heartbeat timeout has not read the heartbeats sent meanwhile."""
        self.apply_received()
        now = time.monotonic()
        if self._ctl_ticked_at is not None and now - self._ctl_ticked_at > self.heartbeat_timeout_s / 2:
            self._ctl_grace_from = now  # the control thread has not run either: what it has not read yet is
            # not a worker's silence (its own tick moves _ctl_ticked_at on once it runs again)
        if self._ticked_at is not None and now - self._ticked_at > self.heartbeat_timeout_s / 2:
            if now - self._grace_from > self.heartbeat_timeout_s / 2:
                log.warning(
                    "router event loop stalled for %.1f s: worker heartbeats are aged from now",
                    now - self._ticked_at,
                )
            self._grace_from = now
        for wid, info in list(self.workers.items()):
            age = self.silent_for(info, now)
            if age > self.forget_after_s and info.state != DEAD:
                log.warning("worker %s (%s) forgotten: no heartbeat for %.1f s", wid, info.role, age)
                del self.workers[wid]
                self.prefix.drop(wid)
                info.expire_waiters()
                continue
            if age > self.heartbeat_timeout_s and info.state in (HEALTHY, SUSPECT):
                # a draining worker stays draining: it never returns to rotation
                transition(info, STALE, f"no heartbeat for {age:.1f} s (timeout {self.heartbeat_timeout_s:.1f} s)")
            if info.state in (STALE, DRAINING) and age > self.fail_waits_after_s:
                info.expire_waiters()
        self.outliers.release_due(self.workers.values(), now)

    def view(self) -> tuple[str | None, dict[str, dict[str, int]], list[WorkerInfo]]:
        """(mode, counts, healthy workers) as ``sweep`` would leave them now, without changing anything: safe
        from the control thread (``GET /health`` there) while the main loop runs behind. A heartbeat waiting
        in the inbox counts as applied; a silence past the timeout as stale."""
        now = time.monotonic()
        with self._inbox_lock:
            pending = {wid: at for wid, (_, at, _) in self._inbox.items()}
        out: dict[str, dict[str, int]] = {}
        healthy: list[WorkerInfo] = []
        for w in list(self.workers.values()):
            st = w.state
            at = pending.get(w.worker_id)
            if at is not None and at >= w.last_seen and st in (STALE, SUSPECT):
                st = HEALTHY
            elif at is None and st in (HEALTHY, SUSPECT) and self.silent_for(w, now) > self.heartbeat_timeout_s:
                st = STALE
            out.setdefault(w.role, dict.fromkeys(STATES, 0))[st] += 1
            if st == HEALTHY:
                healthy.append(w)
        roles = {w.role for w in healthy}
        mode = "disaggregated" if {"prefill", "decode"} <= roles else "colocated" if "colocated" in roles else None
        return mode, out, healthy

    def counts(self) -> dict[str, dict[str, int]]:
        """Workers per role and state (``/health``, ``/metrics``)."""
        out: dict[str, dict[str, int]] = {}
        for w in self.workers.values():
            by_state = out.setdefault(w.role, dict.fromkeys(STATES, 0))
            by_state[w.state] += 1
        return out

    def healthy(self, role: str) -> list[WorkerInfo]:
        self.sweep()
        return [w for w in self.workers.values() if w.role == role and w.healthy]

    def pick(
        self, role: str, exclude: frozenset[str] = frozenset(), token_ids: list[int] | None = None
    ) -> WorkerInfo | None:
        """The best healthy worker of ``role`` (see the class docstring), ejected outliers left out unless
        they are all there is; ``token_ids`` (prompt + tokens generated so far) make the pick cache-aware."""
        candidates = [w for w in self.healthy(role) if w.worker_id not in exclude]
        if not candidates:
            return None
        in_rotation = [w for w in candidates if not w.ejected_until]
        candidates = in_rotation or candidates
        weight = self.prefix_cache_weight
        hits = self.cached_tokens(token_ids if weight else None, candidates)
        n = len(token_ids) if token_ids else 0

        def score(w: WorkerInfo) -> float:
            return w.load() + (weight * (1.0 - hits[w.worker_id] / n) if n and weight else 0.0)

        # Ties (idle workers, light load) go to the least recently picked: a worker that just joined gets
        # the next request instead of waiting until every older one is busy, and idle workers take turns.
        best = min(candidates, key=lambda w: (score(w), w.last_pick_at, w.worker_id))
        self.last_pick_cached_tokens = hits[best.worker_id]
        if hits[best.worker_id]:
            best.prefix_hits += 1
        best.last_pick_at = time.monotonic()
        if best.first_pick_at is None:
            best.first_pick_at = best.last_pick_at
        return best

    def cached_tokens(self, token_ids: list[int] | None, workers: list[WorkerInfo]) -> dict[str, int]:
        """Per worker, the prompt tokens its (fresh) prefix summary says it holds."""
        ids = [w.worker_id for w in workers]
        if not token_ids:
            return dict.fromkeys(ids, 0)
        blocks = self.prefix.expected_hits(token_ids, ids)
        return {w: b * self.prefix.block_size_of(w) for w, b in blocks.items()}

    def mode(self) -> str | None:
        """'disaggregated' when a prefill and a decode worker are healthy, else 'colocated' when a
        colocated worker is, else None."""
        if self.healthy("prefill") and self.healthy("decode"):
            return "disaggregated"
        if self.healthy("colocated"):
            return "colocated"
        return None

    def max_model_len(self) -> int | None:
        lens = [w.max_model_len for w in self.workers.values() if w.state != DEAD]
        return min(lens) if lens else None

    def model_path(self) -> str | None:
        for w in self.workers.values():
            if w.model_path:
                return w.model_path
        return None
