"""Scale-down in the router's registry: a draining worker gets no new request and never returns to
rotation by heartbeating; a replaced process's late goodbye does not remove its successor; the time
from joining to the first request routed to a worker is recorded."""

from __future__ import annotations

import time

from distserve.server.router.registry import WorkerRegistry
from distserve.server.wire import RegisterRequest, WorkerStatus


def _reg(wid: str, role: str = "decode", pid: int = 1) -> RegisterRequest:
    return RegisterRequest(
        worker_id=wid, role=role, url=f"http://127.0.0.1:1/{wid}", pid=pid, fingerprint={"m": 1}, max_model_len=128
    )


def test_a_draining_worker_is_never_picked_even_when_it_heartbeats_or_reregisters():
    reg = WorkerRegistry(heartbeat_timeout_s=5)
    reg.register(_reg("d1"))
    reg.register(_reg("d2"))
    reg.workers["d2"].inflight = 50  # d1 would win every pick on load
    assert reg.drain("d1")
    assert all(reg.pick("decode").worker_id == "d2" for _ in range(5))
    assert reg.heartbeat("d1", WorkerStatus(num_running=2))  # still accepted: its streams are alive
    assert reg.workers["d1"].state == "draining" and reg.pick("decode").worker_id == "d2"
    reg.register(_reg("d1"))  # same process again (a router restart made it register anew)
    assert reg.workers["d1"].state == "draining"
    assert reg.counts()["decode"] == {"healthy": 1, "stale": 0, "suspect": 0, "dead": 0, "draining": 1}
    reg.drain("d2")
    assert reg.pick("decode") is None


def test_drain_of_an_unknown_or_dead_worker_is_refused():
    reg = WorkerRegistry(heartbeat_timeout_s=5)
    assert not reg.drain("nobody")
    reg.register(_reg("d1"))
    reg.mark_dead("d1", "exited with status 1")
    assert not reg.drain("d1")


def test_a_late_goodbye_of_a_replaced_process_keeps_the_replacement():
    reg = WorkerRegistry(heartbeat_timeout_s=5)
    reg.register(_reg("d1", pid=100))
    reg.register(_reg("d1", pid=200))  # replacement under the same id
    assert not reg.deregister("d1", pid=100)
    assert reg.workers["d1"].pid == 200
    assert reg.deregister("d1", pid=200) and "d1" not in reg.workers
    reg.register(_reg("d2", pid=1))
    assert reg.deregister("d2")  # no pid (the launcher, or an older worker): forget whatever is there


def test_join_to_first_request_is_recorded_at_the_first_pick_only():
    reg = WorkerRegistry(heartbeat_timeout_s=5)
    reg.register(_reg("d1"))
    assert reg.workers["d1"].to_dict(time.monotonic())["join_to_first_request_ms"] is None
    time.sleep(0.01)
    reg.pick("decode")
    first = reg.workers["d1"].to_dict(time.monotonic())["join_to_first_request_ms"]
    assert first is not None and first >= 10.0
    time.sleep(0.01)
    reg.pick("decode")
    assert reg.workers["d1"].to_dict(time.monotonic())["join_to_first_request_ms"] == first
    reg.heartbeat("d1", WorkerStatus())
    reg.register(_reg("d1"))  # the same process registering again keeps its join time
    assert reg.workers["d1"].to_dict(time.monotonic())["join_to_first_request_ms"] == first


def test_a_router_stall_does_not_make_its_workers_stale_but_a_silent_worker_still_goes_stale():
    reg = WorkerRegistry(heartbeat_timeout_s=1.0)
    reg.register(_reg("d1"))
    reg.register(_reg("d2"))
    now = time.monotonic()
    # the router's loop did not run for 5 s (its sweeper's last tick): the heartbeats sent meanwhile are unread
    reg._ticked_at = now - 5
    for w in reg.workers.values():
        w.last_seen = now - 5
    reg.sweep()
    assert [w.state for w in reg.workers.values()] == ["healthy", "healthy"]
    assert len(reg.healthy("decode")) == 2  # still in rotation
    reg.tick()
    reg.heartbeat("d1", WorkerStatus())  # d1's queued heartbeat is read; d2 sends none: frozen
    reg._grace_from -= 2  # a heartbeat timeout and more has passed since the stall ended
    reg.workers["d2"].last_seen -= 2
    reg.sweep()
    assert reg.workers["d1"].state == "healthy" and reg.workers["d2"].state == "stale"


def test_without_a_stall_a_silent_worker_goes_stale_as_before():
    reg = WorkerRegistry(heartbeat_timeout_s=1.0)
    reg.register(_reg("d1"))
    reg.tick()  # the router runs normally
    reg.workers["d1"].last_seen -= 2
    reg.sweep()
    assert reg.workers["d1"].state == "stale"


def test_a_router_loop_that_runs_behind_ages_heartbeats_by_its_lag_and_a_silent_worker_still_goes_stale():
    """No stall (every sweeper tick within half a heartbeat timeout) but each woke late: the lag accumulated
    since a worker's heartbeat was read is left out of its age; a worker silent beyond that goes stale."""
    reg = WorkerRegistry(heartbeat_timeout_s=1.0)
    reg.register(_reg("d1"))
    reg.register(_reg("d2"))
    reg.tick()
    for w in reg.workers.values():
        w.last_seen -= 1.5  # 1.5 s since the heartbeats were read...
    reg.tick(late_s=0.4)
    reg.tick(late_s=0.4)  # ...0.8 s of which the router's loop ran behind: aged 0.7 s, not stale
    reg.sweep()
    assert [w.state for w in reg.workers.values()] == ["healthy", "healthy"]
    reg.heartbeat("d1", WorkerStatus())
    reg.workers["d2"].last_seen -= 1.0  # d2 silent 2.5 s, 0.8 s of lag: 1.7 s > the timeout
    reg.sweep()
    assert reg.workers["d1"].state == "healthy" and reg.workers["d2"].state == "stale"
