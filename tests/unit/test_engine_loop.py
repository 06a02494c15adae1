"""EngineLoop: the worker's asyncio driver of the engine (reservations, GC of stale slots, streams)."""

from __future__ import annotations

import asyncio
import time

import pytest

from distserve.server.engine.llm_engine import EngineConfig, LLMEngine
from distserve.server.engine.sampling_params import SamplingParams
from distserve.server.workers.engine_loop import EngineLoop, GcPolicy, resolve_engine_thread

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(block_size=4, num_blocks=12))


async def drain(q: asyncio.Queue) -> list[int]:
    """Every token a request's stream delivers, until it finishes."""
    tokens: list[int] = []
    while True:
        out = await q.get()
        tokens += out.new_token_ids
        if out.finished:
            return tokens


@pytest.fixture(params=[False, True], ids=["inline", "thread"])
def threaded(request):
    """Every behaviour holds in both modes: steps on the event loop, and steps on the engine thread."""
    return request.param


def test_stale_reservations_are_collected(engine, threaded):
    async def main():
        loop = EngineLoop(engine, GcPolicy(interval_s=0.01, stale_after_s=0.05, max_stale_slots=1), threaded=threaded)
        loop.start()
        for i in range(3):  # granted, but the KV never arrives
            await loop.reserve(f"r{i}", [1, 2, 3, 4, 5], [6], PARAMS, timeout_s=5)
        assert engine.num_used_blocks > 0
        for _ in range(200):
            await asyncio.sleep(0.01)
            if engine.num_used_blocks == 0:
                break
        loop.stop()
        return loop.num_gc_collected

    assert asyncio.run(main()) == 3
    engine.block_manager.check_invariants()
    assert engine.num_used_blocks == 0 and not engine.requests


def test_reservation_waits_for_blocks_then_times_out_cleanly(engine, threaded):
    async def main():
        loop = EngineLoop(engine, GcPolicy(interval_s=10, stale_after_s=100), threaded=threaded)
        loop.start()
        await loop.reserve("big", list(range(3, 40)), [5], PARAMS, timeout_s=5)  # 10 blocks of 12
        with pytest.raises(TimeoutError):
            await loop.reserve("waits", list(range(3, 20)), [5], PARAMS, timeout_s=0.2)
        assert "waits" not in engine.requests  # the timed-out reservation left nothing behind
        assert loop.abort_nowait("big")
        await loop.reserve("now-fits", list(range(3, 20)), [5], PARAMS, timeout_s=5)
        assert loop.abort_nowait("now-fits")
        loop.stop()

    asyncio.run(main())
    assert engine.num_used_blocks == 0 and not engine.requests


def test_stream_gets_tokens_and_abort_frees(engine, threaded):
    async def main():
        loop = EngineLoop(engine, threaded=threaded)
        loop.start()
        q = await loop.add_request("s", [1, 9, 8, 7], PARAMS)
        tokens = await drain(q)
        q2 = await loop.add_request("t", [1, 9, 8, 7], SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True))
        await q2.get()
        assert loop.abort_nowait("t")
        loop.stop()
        return tokens

    tokens = asyncio.run(main())
    assert tokens == engine.generate([[1, 9, 8, 7]], PARAMS)[0]
    assert engine.num_used_blocks == 0


def test_reservations_whose_pull_may_still_run_are_never_stale(engine, threaded):
    """A burst holds more reservations than max_stale_slots while their pulls run (seen under load:
    "kv commit failed: has no reservation"): none is collected before it is older than stale_after_s."""

    async def main():
        loop = EngineLoop(engine, GcPolicy(interval_s=0.01, stale_after_s=60, max_stale_slots=0), threaded=threaded)
        loop.start()
        for i in range(3):
            await loop.reserve(f"p{i}", [1, 2, 3], [6], PARAMS, timeout_s=5)
        await asyncio.sleep(0.2)  # many GC ticks
        assert loop.collect_stale_slots() == 0 and loop.num_gc_collected == 0
        for i in range(3):
            assert loop.abort_nowait(f"p{i}")
        loop.stop()

    asyncio.run(main())
    assert engine.num_used_blocks == 0 and not engine.requests


class _SlowSteps:
    """Wraps a real engine's ``step`` with a wait that releases the GIL, as a GPU step's device wait does."""

    def __init__(self, engine: LLMEngine, seconds: float) -> None:
        self.engine, self.seconds, self.orig = engine, seconds, engine.step
        self.in_step = False

    def __enter__(self):
        def step():
            self.in_step = True
            try:
                time.sleep(self.seconds)
                return self.orig()
            finally:
                self.in_step = False

        self.engine.step = step
        return self

    def __exit__(self, *exc):
        del self.engine.step


def test_thread_mode_keeps_the_event_loop_serving_during_a_step(engine):
    """The point of the engine thread: handlers run while a step runs. In inline mode the same slow
    step blocks the loop, so the ticker below would tick about once per step instead."""

    async def main(threaded: bool) -> int:
        loop = EngineLoop(engine, threaded=threaded)
        loop.start()
        with _SlowSteps(engine, 0.1):
            q = await loop.add_request("slow", [1, 9, 8, 7], SamplingParams(max_tokens=3, temperature=0.0))
            ticks = 0
            while True:
                try:
                    async with asyncio.timeout(0.005):
                        out = await q.get()
                    if out.finished:
                        break
                except TimeoutError:
                    ticks += 1
        loop.stop()
        return ticks

    threaded_ticks = asyncio.run(main(True))
    inline_ticks = asyncio.run(main(False))
    assert threaded_ticks > 3 * max(inline_ticks, 1), (threaded_ticks, inline_ticks)
    assert engine.num_used_blocks == 0 and not engine.requests


def test_thread_mode_queues_engine_calls_made_during_a_step(engine):
    """add_request, abort and call() made while a step runs are applied after it, in order, never
    concurrently with it: the engine is touched by one thread at a time."""

    async def main():
        loop = EngineLoop(engine, threaded=True)
        loop.start()
        with _SlowSteps(engine, 0.05) as slow:
            long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
            q = await loop.add_request("a", [1, 9, 8, 7], long)
            await q.get()  # "a" is running: steps follow each other
            while not slow.in_step:
                await asyncio.sleep(0.001)
            seen_in_step = []
            q2_task = asyncio.ensure_future(loop.add_request("b", [1, 2, 3], PARAMS))
            called = asyncio.ensure_future(loop.call(lambda: seen_in_step.append(slow.in_step) or "done"))
            assert loop.abort_nowait("a")  # known to the engine; aborted before the next step
            assert await called == "done" and seen_in_step == [False]
            q2 = await q2_task
            assert "a" not in engine.requests
            tokens = await drain(q2)
        loop.stop()
        return tokens

    tokens = asyncio.run(main())
    assert tokens == engine.generate([[1, 2, 3]], PARAMS)[0]
    assert engine.num_used_blocks == 0 and not engine.requests
    engine.block_manager.check_invariants()


def test_status_tells_a_reservation_short_of_blocks_from_one_waiting_for_the_step(engine):
    """Decode room (the router's gate) closes on ``num_kv_blocked``: a reservation refused by the KV pool. One
    made while a step runs waits only for that step to end; a heartbeat that caught it must not read it as a
    full pool (it closed the router's gate for a whole heartbeat interval on the GPU: 17 % of requests shed
    at 1x capacity)."""

    async def main():
        loop = EngineLoop(engine, GcPolicy(interval_s=10, stale_after_s=100), threaded=True)
        loop.start()
        with _SlowSteps(engine, 0.05) as slow:
            long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
            q = await loop.add_request("a", [1, 9, 8, 7], long)
            await q.get()
            while not slow.in_step:
                await asyncio.sleep(0.001)
            deferred = asyncio.ensure_future(loop.reserve("small", [1, 2, 3], [6], PARAMS, timeout_s=5))
            await asyncio.sleep(0)
            during = loop.status()
            await deferred
            assert loop.abort_nowait("small")
            # now a reservation the pool cannot hold while "a" runs: 12 blocks of 4, "a" holds some
            blocked = asyncio.ensure_future(loop.reserve("big", list(range(3, 44)), [5], PARAMS, timeout_s=5))
            for _ in range(100):
                await asyncio.sleep(0.01)
                if loop.status().num_kv_blocked:
                    break
            refused = loop.status()
            assert loop.abort_nowait("a")  # its blocks come back: "big" fits
            await blocked
            after = loop.status()
            assert loop.abort_nowait("big")
        loop.stop()
        return during, refused, after

    during, refused, after = asyncio.run(main())
    assert during.num_reserving == 1 and during.num_kv_blocked == 0
    assert refused.num_reserving == 1 and refused.num_kv_blocked == 1
    assert after.num_reserving == 0 and after.num_kv_blocked == 0
    assert engine.num_used_blocks == 0 and not engine.requests
    engine.block_manager.check_invariants()


def test_a_reservation_behind_a_full_batch_is_not_short_of_blocks():
    """max_num_seqs running: the next reservation waits for a sequence to end, which the router's decode slots
    already bound; it is not a pool short of KV blocks, so the router's gate stays open."""
    engine = LLMEngine(EngineConfig(block_size=4, num_blocks=64, max_num_seqs=1))

    async def main():
        loop = EngineLoop(engine, GcPolicy(interval_s=10, stale_after_s=100))
        loop.start()
        q = await loop.add_request("a", [1, 9, 8, 7], SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True))
        await q.get()
        waiting = asyncio.ensure_future(loop.reserve("b", [1, 2, 3], [6], PARAMS, timeout_s=5))
        for _ in range(100):
            await asyncio.sleep(0.01)
            if loop.status().num_reserving:
                break
        full = loop.status()
        assert loop.abort_nowait("a")
        await waiting
        assert loop.abort_nowait("b")
        loop.stop()
        return full

    full = asyncio.run(main())
    assert full.num_reserving == 1 and full.num_kv_blocked == 0
    assert engine.num_used_blocks == 0 and not engine.requests


def test_engine_thread_setting():
    assert resolve_engine_thread("auto", "cuda:1") and resolve_engine_thread("on", "cpu")
    assert not resolve_engine_thread("auto", "cpu") and not resolve_engine_thread("off", "cuda")
    # prefill workers step on a thread on CPU too: a reply (and its KV lease) must not wait a whole next step
    assert resolve_engine_thread("auto", "cpu", "prefill") and not resolve_engine_thread("off", "cpu", "prefill")
    assert not resolve_engine_thread("auto", "cpu", "decode") and not resolve_engine_thread("auto", "cpu", "colocated")


def test_thread_mode_a_handler_cancelled_after_its_queued_add_ran_leaves_nothing(engine):
    """The one window thread mode opens: a handler's add_request queued behind a step runs, and the
    handler is cancelled (client gone) before it resumes. Its request must not stay in the engine."""

    async def main():
        loop = EngineLoop(engine, threaded=True)
        loop.start()
        orig_add = engine.add_request
        with _SlowSteps(engine, 0.05) as slow:
            long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
            q = await loop.add_request("busy", [1, 9, 8, 7], long)
            await q.get()
            while not slow.in_step:
                await asyncio.sleep(0.001)
            task: asyncio.Task | None = None

            def add_then_client_leaves(*a, **kw):
                orig_add(*a, **kw)
                assert task is not None
                task.cancel()  # after the add, before the handler resumes

            engine.add_request = add_then_client_leaves
            try:
                task = asyncio.ensure_future(loop.add_request("gone", [1, 2, 3], PARAMS))
                with pytest.raises(asyncio.CancelledError):
                    await task
            finally:
                del engine.add_request
            for _ in range(100):  # the abort is queued behind the running step
                if "gone" not in engine.requests:
                    break
                await asyncio.sleep(0.01)
            assert "gone" not in engine.requests
            assert loop.abort_nowait("busy")
        q = await loop.add_request("after", [1, 2, 3], PARAMS)  # the loop survived it and still serves
        tokens = await drain(q)
        assert len(tokens) == PARAMS.max_tokens
        loop.stop()

    asyncio.run(main())
    for _ in range(100):
        if not engine.requests:
            break
        time.sleep(0.01)
    assert engine.num_used_blocks == 0 and not engine.requests
    engine.block_manager.check_invariants()


def test_an_abort_releases_the_handler_waiting_on_its_stream(engine):
    """POST /internal/abort of a request whose caller gave up: its handler, waiting on the stream, gets a
    final "abort" output now, not at its timeout (the stuck prefill handlers after an overload)."""

    async def main() -> str | None:
        loop = EngineLoop(engine)  # not started: the request stays queued, as behind a long queue
        q = await loop.add_request("stuck-1", [1, 2, 3], PARAMS)
        waiter = asyncio.ensure_future(q.get())
        await asyncio.sleep(0)
        assert loop.abort_nowait("stuck-1")
        out = await asyncio.wait_for(waiter, 5)
        assert out.finished and not engine.has_unfinished_requests()
        return out.finish_reason

    assert asyncio.run(main()) == "abort"


def test_thread_mode_an_id_aborted_and_added_again_during_a_step_gets_only_its_own_outputs(engine):
    """A prefill sent again under the same id (the router's retry) while its first attempt is inside the running
    step: that step's output of the aborted attempt is not the new attempt's, and the first attempt's handler,
    closing its stream on the way out, does not close the new attempt's."""

    async def main():
        loop = EngineLoop(engine, threaded=True)
        loop.start()
        with _SlowSteps(engine, 0.2) as slow:
            q1 = await loop.add_request("same", [1, 9, 8, 7, 6], PARAMS, prefill_only=True)
            while not slow.in_step:
                await asyncio.sleep(0.001)
            loop.abort_nowait("same")  # the worker's "sent again" path
            q2 = await loop.add_request("same", [1, 9, 8, 7, 6], PARAMS, prefill_only=True)
            first_out = await q1.get()
            loop.close_stream("same", q1)  # the first attempt's handler leaves
            out = await asyncio.wait_for(q2.get(), 10)
            seq = engine.requests.get("same")
            status = seq.status.name if seq is not None else None
            assert out.finish_reason == "prefilled" and status == "FINISHED_PREFILLED", (out, status)
            engine.take_prefilled_kv("same")
        loop.stop()
        return first_out.finish_reason

    assert asyncio.run(main()) == "abort"
    assert engine.num_used_blocks == 0 and not engine.requests
    engine.block_manager.check_invariants()


def test_a_request_added_during_a_step_arrives_when_it_was_sent_not_when_the_step_ends(engine):
    """The wfs prefill order ages a prompt from its arrival. A call made while a step runs is applied after
    the step, and before, the sequence took that moment as its arrival: every prompt of a burst tied at the
    step's end (on a CPU step of seconds, whoever came first), so aging did not tell them apart."""

    async def main():
        loop = EngineLoop(engine, threaded=True)
        loop.start()
        with _SlowSteps(engine, 0.2) as slow:
            long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
            q = await loop.add_request("a", [1, 9, 8, 7], long)
            await q.get()
            while not slow.in_step:
                await asyncio.sleep(0.001)
            t0 = time.monotonic()
            task = asyncio.ensure_future(loop.add_request("b", [1, 2, 3], PARAMS))
            await asyncio.sleep(0)  # the handler runs up to its queued engine call
            t1 = time.monotonic()
            still_in_step = slow.in_step
            q2 = await task
            arrival = engine.requests["b"].arrival_time
            loop.abort_nowait("a")
            await drain(q2)
        loop.stop()
        return t0, t1, still_in_step, arrival

    t0, t1, still_in_step, arrival = asyncio.run(main())
    assert still_in_step  # the add waited for the step (else this test shows nothing)
    assert t0 <= arrival <= t1
    assert engine.num_used_blocks == 0 and not engine.requests
