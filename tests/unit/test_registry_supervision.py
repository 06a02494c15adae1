"""The router's worker registry (states, picks, failing the waits on a frozen or dead worker) and the
launcher's supervision of its workers, as units."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from distserve.server.config import DistServeConfig
from distserve.server.idle import IdleTimeout
from distserve.server.launcher import Launcher, RestartPolicy, _Worker
from distserve.server.router.registry import WorkerRegistry
from distserve.server.wire import RegisterRequest, WorkerStatus


def _reg(wid: str, role: str = "decode", pid: int = 1) -> RegisterRequest:
    return RegisterRequest(
        worker_id=wid, role=role, url=f"http://127.0.0.1:1/{wid}", pid=pid, fingerprint={"m": 1}, max_model_len=128
    )


def test_picks_count_from_the_pick_so_a_burst_alternates():
    reg = WorkerRegistry(heartbeat_timeout_s=5)
    reg.register(_reg("d1"))
    reg.register(_reg("d2"))
    picked = []
    for _ in range(6):  # what the pipeline does: pick, then count the request at once
        w = reg.pick("decode")
        w.inflight += 1
        picked.append(w.worker_id)
    assert picked.count("d1") == 3 and picked.count("d2") == 3


def test_states_dead_workers_report_no_load_and_come_back_by_registering():
    reg = WorkerRegistry(heartbeat_timeout_s=5)
    reg.register(_reg("d1"))
    reg.heartbeat("d1", WorkerStatus(kv_blocks_used=7, kv_blocks_free=9))
    assert reg.mark_dead("d1", "exited with status 1")
    info = reg.workers["d1"].to_dict(time.monotonic())
    assert info["state"] == "dead" and info["kv_blocks_used"] is None and info["dead_reason"] == "exited with status 1"
    assert reg.pick("decode") is None and reg.mode() is None
    assert not reg.heartbeat("d1", WorkerStatus())  # a dead worker must register again
    reg.register(_reg("d1", pid=2))
    assert reg.workers["d1"].healthy and reg.counts() == {
        "decode": {"healthy": 1, "stale": 0, "suspect": 0, "dead": 0, "draining": 0}
    }
    reg.mark_suspect("d1")
    assert reg.workers["d1"].state == "suspect" and reg.pick("decode") is None
    reg.heartbeat("d1", WorkerStatus())
    assert reg.workers["d1"].healthy


def test_waits_fail_when_the_worker_dies_or_stays_silent_past_the_deadline():
    async def main():
        reg = WorkerRegistry(heartbeat_timeout_s=0.05, fail_waits_after_s=0.3)
        reg.register(_reg("p", role="prefill"))
        reg.register(_reg("d"))

        async def wait_on(wid: str) -> str:
            idle = IdleTimeout(60)
            with reg.workers[wid].watch(idle):
                try:
                    await idle.wait(asyncio.sleep(3600))
                except TimeoutError:
                    return idle.reason
            return "not expired"

        dead_wait = asyncio.ensure_future(wait_on("p"))
        await asyncio.sleep(0.01)
        reg.mark_dead("p", "connection refused")
        assert "dead (connection refused)" in await dead_wait
        silent_wait = asyncio.ensure_future(wait_on("d"))
        await asyncio.sleep(0.1)
        reg.sweep()  # stale now: out of rotation, but its wait goes on (a long step also delays heartbeats)
        assert reg.workers["d"].state == "stale" and not silent_wait.done()
        await asyncio.sleep(0.3)
        reg.sweep()
        assert "sent no heartbeat" in await silent_wait

    asyncio.run(main())


@pytest.fixture
def launcher(tmp_path):
    la = Launcher(
        DistServeConfig(),
        "disaggregated",
        1,
        1,
        "tok",
        log_dir=tmp_path,
        restart=RestartPolicy(max_restarts=1, window_s=60, backoff_s=0.2),
    )
    yield la
    la.stop(grace_s=5)


def _exited(rc: int) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({rc})"])
    p.wait()
    return p


def test_supervisor_restarts_with_backoff_then_stops_a_crash_loop(launcher):
    # argv that makes `python -m distserve.server.cli` exit 0 at once when restarted
    w = _Worker("decode-0", ["make-tiny-model", "--help"], None, None, _exited(1))
    launcher.supervised["decode-0"] = w
    launcher.procs.append(w.proc)
    t0 = time.monotonic()
    events = launcher.supervise(t0)
    assert events == ["worker decode-0 exited with status 1; restarting in 0.2 s"]
    assert launcher.supervise(t0 + 0.1) == []  # backoff not over
    events = launcher.supervise(t0 + 0.25)
    assert events[0].startswith("worker decode-0 restarted") and w.proc.args[-2:] == ["--restart-count", "1"]
    w.proc.wait(60)
    events = launcher.supervise(t0 + 0.5)  # the restarted process exited too: second exit in the window
    assert "crash loop: 2 exits within 60 s" in events[0] and w.given_up
    assert launcher.supervise(t0 + 100) == []


def test_supervisor_never_restarts_a_refused_worker(launcher):
    w = _Worker("prefill-0", ["--help"], None, None, _exited(3))
    launcher.supervised["prefill-0"] = w
    events = launcher.supervise()
    assert "the router refused its registration" in events[0] and w.given_up
