"""Out-of-memory in a step: only that step's requests pay, the worker stays up, /metrics
counts it and /health says degraded while it lasts — driven through the fault hook that makes the
model forward raise torch.cuda.OutOfMemoryError, on the real tiny engine and the real worker app."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from distserve.server.config import DistServeConfig, load_config
from distserve.server.engine.llm_engine import EngineConfig, LLMEngine
from distserve.server.engine.memory_pressure import MemoryPressure, is_memory_error
from distserve.server.engine.sampling_params import SamplingParams
from distserve.server.metrics import WorkerMetrics
from distserve.server.workers.app import WorkerState, create_worker_app
from distserve.server.workers.engine_loop import EngineLoop
from distserve.server.workers.fault import arm_oom

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture()
def engine():
    return LLMEngine(EngineConfig(block_size=4, num_blocks=64, enable_prefix_caching=False))


def test_memory_errors_are_recognised():
    assert is_memory_error(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB"))
    assert is_memory_error(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))
    assert not is_memory_error(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not is_memory_error(ValueError("out of memory"))
    p = MemoryPressure(window_s=30)
    p.record(now=100.0)
    p.record(now=120.0)
    assert (p.recent(now=125.0), p.recent(now=140.0), p.recent(now=151.0), p.total) == (2, 1, 0, 2)


def test_one_oom_batch_is_retried_one_by_one_and_every_request_finishes(engine):
    want = {f"r{i}": engine.generate([[3 + i, 9, 8, 7, 6]], PARAMS)[0] for i in range(3)}
    for i in range(3):
        engine.add_request(f"r{i}", [3 + i, 9, 8, 7, 6], PARAMS)
    arm_oom(engine, 1)  # the batched forward fails; each sequence alone fits
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}
    errors = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
            errors += [out.error] if out.error else []
    assert not errors and got == want
    assert engine.memory_pressure.total == 1 and engine.memory_pressure.recent() == 1
    engine.block_manager.check_invariants()
    assert engine.num_used_blocks == 0


def test_oom_fails_only_the_requests_of_that_step(engine):
    engine.add_request("in-step-a", [3, 9, 8, 7], PARAMS)
    engine.add_request("in-step-b", [4, 9, 8, 7], PARAMS)
    arm_oom(engine, 3)  # the batch and both retries alone
    outs = engine.step()
    failed = {o.request_id: o.error for o in outs if o.finished}
    assert set(failed) == {"in-step-a", "in-step-b"}
    assert all("OutOfMemoryError" in e and "out of memory" in e.lower() for e in failed.values())
    assert engine.num_used_blocks == 0  # their blocks came back
    engine.add_request("after", [5, 9, 8, 7], PARAMS)  # the engine goes on
    tokens, finished = [], None
    while engine.has_unfinished_requests():
        for o in engine.step():
            tokens += o.new_token_ids
            finished = o
    assert finished is not None and finished.error is None and len(tokens) == PARAMS.max_tokens
    assert engine.memory_pressure.total == 3


def test_worker_reports_oom_on_metrics_and_health_and_keeps_serving(engine):
    async def main():
        loop = EngineLoop(engine, threaded=True)
        state = WorkerState(
            role="colocated",
            worker_id="c0",
            config=DistServeConfig(),
            token="t",
            loop=loop,
            metrics=WorkerMetrics("colocated"),
        )
        app = create_worker_app(state)
        loop.start()
        auth = {"Authorization": "Bearer t"}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as http:
            assert (await http.get("/health")).json()["status"] == "ok"
            r = await http.post("/admin/fault", json={"oom_forwards": 2}, headers=auth)
            assert r.status_code == 200 and r.json()["oom_forwards"] == 2
            qs = [await loop.add_request(f"x{i}", [3 + i, 9, 8, 7], PARAMS) for i in range(2)]
            outs = []
            for q in qs:
                while True:
                    o = await q.get()
                    if o.finished:
                        outs.append(o)
                        break
            health = (await http.get("/health")).json()
            metrics = (await http.get("/metrics")).text
            status = state.status()
            # a later request is served normally
            q = await loop.add_request("later", [7, 9, 8, 7], PARAMS)
            while not (o := await q.get()).finished:
                pass
        loop.stop()
        return outs, health, metrics, status, o

    outs, health, metrics, status, later = asyncio.run(main())
    assert health["status"] == "degraded" and "lack of device memory" in health["reason"]
    assert "distserve_memory_errors 2.0" in metrics and "distserve_memory_errors_recent 2.0" in metrics
    assert status.memory_errors_recent == 2
    assert later.error is None
    # the batch of two failed, then the first retried alone failed: that request alone is lost
    assert sorted(o.error is None for o in outs) == [False, True]
    engine.block_manager.check_invariants()
    assert engine.num_used_blocks == 0


def test_router_health_is_degraded_while_a_worker_reports_memory_errors_and_workers_show_sizing():
    from distserve.server.router.app import RouterState, create_router_app
    from distserve.server.router.registry import WorkerRegistry
    from distserve.server.wire import RegisterRequest, WorkerStatus

    reg = WorkerRegistry(heartbeat_timeout_s=30)
    fp = {"architecture": "llama"}
    sizing = {"gpu_memory_utilization": 0.63, "kv_cache_mib": 70000, "headroom_mib": 1024}
    for role in ("prefill", "decode"):
        reg.register(
            RegisterRequest(
                worker_id=f"{role}-0",
                role=role,
                url="http://127.0.0.1:1",
                pid=1,
                fingerprint=fp,
                max_model_len=64,
                memory=sizing if role == "decode" else None,
            )
        )
    app = create_router_app(RouterState(config=DistServeConfig(), token="t", registry=reg))

    async def get(path):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as http:
            return (await http.get(path, headers={"Authorization": "Bearer t"})).json()

    assert asyncio.run(get("/health"))["status"] == "ok"
    reg.heartbeat("decode-0", WorkerStatus(memory_errors_recent=3))
    h = asyncio.run(get("/health"))
    assert h["status"] == "degraded" and h["memory_pressure"] == ["decode-0"]
    ws = {w["worker_id"]: w for w in asyncio.run(get("/v1/workers"))["workers"]}
    assert ws["decode-0"]["memory"] == sizing and ws["decode-0"]["memory_errors_recent"] == 3
    assert ws["prefill-0"]["memory"] is None
    reg.heartbeat("decode-0", WorkerStatus())  # the errors aged out of the worker's window
    assert asyncio.run(get("/health"))["status"] == "ok"


def test_prefill_worker_out_of_memory_after_its_step_fails_that_request_and_frees_its_blocks(engine):
    """The KV gather of a prefilled prompt (out of the pool, before staging) runs out of memory: that request
    gets a clear error in its answer (not a 500), its blocks come back, /health says degraded, and the next
    request is served."""
    from distserve.server.wire import PrefillResponse

    async def main():
        loop = EngineLoop(engine, threaded=True)
        state = WorkerState(
            role="prefill",
            worker_id="p0",
            config=DistServeConfig(),
            token="t",
            loop=loop,
            metrics=WorkerMetrics("prefill"),
        )
        app = create_worker_app(state)
        loop.start()
        auth = {"Authorization": "Bearer t"}
        sampling = {"max_tokens": 4, "temperature": 0.0, "top_p": 1.0, "ignore_eos": True}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as http:
            r = await http.post("/admin/fault", json={"oom_kv_takes": 1}, headers=auth)
            assert r.status_code == 200 and r.json()["oom_kv_takes"] == 1
            body = {"request_id": "big", "prompt_token_ids": [3, 9, 8, 7, 6, 5], "sampling": sampling}
            failed = await http.post("/internal/prefill", json=body, headers=auth)
            used = engine.num_used_blocks
            health = (await http.get("/health")).json()
            # the next one (stopping at token #1: no staging needed) is served
            again = {**body, "request_id": "next", "sampling": {**sampling, "max_tokens": 1}}
            ok = await http.post("/internal/prefill", json=again, headers=auth)
        loop.stop()
        return failed, used, health, ok

    failed, used, health, ok = asyncio.run(main())
    assert failed.status_code == 200, failed.text
    ans = PrefillResponse.model_validate(failed.json())
    assert ans.finished and ans.finish_reason == "abort" and not ans.token_ids
    assert ans.error is not None and "out of device memory" in ans.error
    assert used == 0 and engine.requests == {}
    assert health["status"] == "degraded"
    nxt = PrefillResponse.model_validate(ok.json())
    assert nxt.error is None and len(nxt.token_ids) == 1
    engine.block_manager.check_invariants()


def _prefill_state(engine, sender=None, request_timeout_s: float | None = None) -> WorkerState:
    cfg = (
        DistServeConfig()
        if request_timeout_s is None
        else load_config(overrides={"router": {"request_timeout_s": request_timeout_s}})
    )
    return WorkerState(
        role="prefill",
        worker_id="p0",
        config=cfg,
        token="t",
        loop=EngineLoop(engine, threaded=True),
        metrics=WorkerMetrics("prefill"),
        sender=sender,
    )


@pytest.mark.parametrize("persistent", [False, True], ids=["memory-comes-back", "never"])
def test_a_kv_gather_out_of_memory_waits_while_other_hand_offs_hold_kv_here(engine, persistent):
    """The gather runs out of device memory while another prefill's KV is staged here (memory that comes back
    when it is pulled): the request waits and retries with its blocks kept, instead of failing (on one H200 by
    reference 8 of 100 requests failed so while leases waited for decode room). Memory that never comes back
    fails it at the request's timeout, its blocks freed."""
    from distserve.server.kv_transfer import KVStagingServer
    from distserve.server.wire import PrefillResponse

    async def main(sender):
        state = _prefill_state(engine, sender, request_timeout_s=1.0 if persistent else None)
        app = create_worker_app(state)
        state.loop.start()
        auth = {"Authorization": "Bearer t"}
        sampling = {"max_tokens": 4, "temperature": 0.0, "top_p": 1.0, "ignore_eos": True}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as http:
            first = {"request_id": "a", "prompt_token_ids": [3, 9, 8, 7, 6, 5], "sampling": sampling}
            staged = await http.post("/internal/prefill", json=first, headers=auth)
            assert staged.status_code == 200 and sender.num_staged == 1, staged.text
            r = await http.post("/admin/fault", json={"oom_kv_takes": 1000 if persistent else 1}, headers=auth)
            assert r.status_code == 200
            second = {**first, "request_id": "b", "prompt_token_ids": [3, 4, 5, 6, 7, 8, 9]}
            answer = await http.post("/internal/prefill", json=second, headers=auth)
            await http.post("/admin/fault", json={"oom_kv_takes": 0}, headers=auth)
            metrics = (await http.get("/metrics", headers=auth)).text
        state.loop.stop()
        sender.abort("a")
        sender.abort("b")
        return PrefillResponse.model_validate(staged.json()), PrefillResponse.model_validate(answer.json()), metrics

    with KVStagingServer() as sender:
        a, b, metrics = asyncio.run(main(sender))
    assert a.kv is not None and a.error is None
    assert "distserve_kv_gather_memory_waits_total 1.0" in metrics
    if persistent:
        assert b.finished and b.finish_reason == "abort" and "out of device memory" in (b.error or "")
    else:
        assert b.error is None and b.kv is not None and len(b.token_ids) == 1
    assert engine.num_used_blocks == 0 and engine.requests == {}
    engine.block_manager.check_invariants()
