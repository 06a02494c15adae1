"""The run loop: sends the workload at the strategy's times (open loop) or from N users (closed loop).

Open loop: send times are fixed in advance and TTFT/E2E are measured from the *scheduled* time (wrk2's
rule), so a client or server that falls behind cannot hide queueing; how late each send went out is
recorded (``sent - scheduled``). Closed loop: each user sends its next request when the previous one
finished (scheduled == sent); a user whose request failed fast (within ``backoff_max_s``) first waits a
jittered, doubling back-off (``backoff_s`` .. ``backoff_max_s``; recorded per request as ``backoff``), so a
failing server is not flooded; a user refused with 429 + Retry-After waits the Retry-After (at most
``MAX_RETRY_AFTER_S``, plus up to 10 % jitter) instead, as an OpenAI client does. Multi-turn sessions run
their turns in order; a later turn is due when the previous one finished.

Stopping: at ``duration_s`` sending ends and the requests in flight drain for up to ``drain_s``; on
``stop`` (an asyncio.Event: Ctrl-C, --stop-on-saturation) they get ``grace_s``. ``on_drain`` is told how
many are draining and for how long. Whatever is still in flight after that is cancelled and recorded as
``cancelled`` (``RequestRecord.cancelled``): counted, never dropped, and never a success.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import aiohttp

from distserve.distbench.client import body_for, send
from distserve.distbench.datasets import Item, Vocab
from distserve.distbench.records import RequestRecord
from distserve.distbench.sampling import DEFAULT as DEFAULT_SAMPLING
from distserve.distbench.sampling import sampling_fields
from distserve.distbench.strategies import schedule

MAX_RETRY_AFTER_S = 60.0  # closed loop: the longest Retry-After a user honours (OpenAI's Python client's cap)


@dataclass(frozen=True)
class RunSpec:
    url: str  # base URL, no /v1
    endpoint: str = "/v1/completions"
    strategy: str = "poisson"  # closed | poisson | gamma | constant | trace
    request_rate: float | None = None
    burstiness: float = 1.0
    concurrency: int | None = None
    max_concurrency: int | None = None  # open loop: at most this many in flight; the rest are sent late
    num_prompts: int = 100
    duration_s: float | None = None
    warmup: int = 0
    seed: int = 0
    model: str | None = None
    timeout_s: float = 600.0
    time_scale: float = 1.0  # trace replay: 2.0 = twice as fast
    grace_s: float = 5.0  # after a stop (Ctrl-C, saturation): how long requests in flight may finish
    drain_s: float = 30.0  # after --duration: how long requests in flight may finish
    backoff_s: float = 0.05  # closed loop: first back-off after a fast failure (0: none)
    backoff_max_s: float = 2.0  # ... doubling up to this; a failure slower than this is not "fast"
    vllm_schedule: bool = False  # --compat vllm: vLLM's normalized arrival times (vllm_compat.vllm_offsets)
    sampling: str = DEFAULT_SAMPLING  # --sampling: greedy | openai-default | T,top_p[,top_k]

    def __post_init__(self) -> None:
        sampling_fields(self.sampling)  # ValueError naming --sampling
        if self.strategy == "closed":
            if not self.concurrency or self.concurrency < 1:
                raise ValueError("--concurrency must be >= 1 for the closed loop")
        elif self.strategy != "trace" and not (self.request_rate and self.request_rate > 0):
            raise ValueError(f"--request-rate must be > 0 for --strategy {self.strategy}")
        if self.num_prompts < 1:
            raise ValueError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        if self.burstiness <= 0:
            raise ValueError(f"--burstiness must be > 0, got {self.burstiness}")
        if self.time_scale <= 0:
            raise ValueError(f"--time-scale must be > 0, got {self.time_scale}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")
        if self.drain_s < 0:
            raise ValueError(f"--drain-timeout must be >= 0, got {self.drain_s}")
        if self.backoff_s < 0 or self.backoff_max_s < self.backoff_s:
            raise ValueError("--backoff BASE:MAX needs 0 <= BASE <= MAX")


def _jobs(items: list[Item], n: int) -> Iterator[list[int]]:
    """Item indices grouped into jobs: a session's consecutive turns together, else one item each;
    items are cycled to reach n."""
    job: list[int] = []
    for i in range(n):
        it = items[i % len(items)]
        if job and (it.session is None or it.session != items[job[0] % len(items)].session or it.turn == 0):
            yield job
            job = []
        job.append(i)
    if job:
        yield job


async def run_load(
    spec: RunSpec,
    items: list[Item],
    vocab: Vocab | None = None,
    on_done: Callable[[RequestRecord], None] | None = None,
    on_sent: Callable[[RequestRecord], None] | None = None,
    stop: asyncio.Event | None = None,
    on_drain: Callable[[str, int, float], None] | None = None,
) -> tuple[list[RequestRecord], float, float]:
    """Returns (records in send order incl. warm-up, measured duration s, unix time of the start)."""
    stop = stop or asyncio.Event()
    in_flight, over = [0], [False]  # requests in flight; the drain ran out
    sampling = sampling_fields(spec.sampling)
    timeout = aiohttp.ClientTimeout(total=spec.timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as http:
        records: list[RequestRecord] = []
        gate = asyncio.Semaphore(spec.max_concurrency) if spec.max_concurrency else contextlib.nullcontext()

        async def one(i: int, rec: RequestRecord, t0: float) -> None:
            it = items[i % len(items)]
            rec.prompt_tokens, rec.session, rec.turn = it.prompt_len, it.session, it.turn
            records.append(rec)
            if on_sent:
                on_sent(rec)
            in_flight[0] += 1
            try:
                async with gate:  # waiting here makes the send late: recorded, never hidden
                    await send(
                        http, spec.url, spec.endpoint, body_for(spec.endpoint, it, spec.model, vocab, sampling), rec, t0
                    )
            except asyncio.CancelledError:
                if rec.error is None:  # still waiting for a --max-concurrency slot
                    rec.error = "cancelled: waiting for a send slot when the run stopped"
                    rec.cancelled_after = time.perf_counter() - t0 - rec.scheduled
                raise
            finally:
                in_flight[0] -= 1
            if on_done:
                on_done(rec)

        if spec.warmup:  # excluded from every figure; its own clock
            tw, uw = time.perf_counter(), time.time()
            await asyncio.gather(
                *(one(i, RequestRecord(-1 - i, 0.0, start_unix=uw, warmup=True), tw) for i in range(spec.warmup))
            )
            for r in records:
                r.scheduled = r.sent
        t0, unix0 = time.perf_counter(), time.time()
        deadline = t0 + spec.duration_s if spec.duration_s else None
        tasks: set[asyncio.Task] = set()
        jobs = _jobs(items, spec.num_prompts)  # lazily: a long closed-loop run needs no huge list

        def new_rec(i: int, offset: float, backoff: float = 0.0) -> RequestRecord:
            return RequestRecord(i, offset, start_unix=unix0 + offset, backoff=backoff)

        def sending_over() -> bool:
            return over[0] or stop.is_set() or (deadline is not None and time.perf_counter() >= deadline)

        async def run_job(job: list[int], first_offset: float, backoff: float = 0.0) -> RequestRecord | None:
            offset, rec = first_offset, None
            for k, i in enumerate(job):
                if k and sending_over():
                    break
                rec = new_rec(i, offset, backoff if k == 0 else 0.0)
                await one(i, rec, t0)
                offset = time.perf_counter() - t0  # the next turn is due now
            return rec

        if spec.strategy == "closed":

            async def user(u: int) -> None:
                rng = random.Random(spec.seed * 1_000_003 + u)  # the back-off's jitter, per user
                fails, wait = 0, 0.0
                while not sending_over():
                    job = next(jobs, None)
                    if job is None:
                        return
                    last = await run_job(job, time.perf_counter() - t0, wait)
                    wait = 0.0
                    if last is not None and last.retry_after is not None:
                        # a 429 with Retry-After: wait what the server asked (as OpenAI's client does, up to
                        # MAX_RETRY_AFTER_S), plus up to 10 % jitter so the refused users do not return together
                        ra = min(last.retry_after, MAX_RETRY_AFTER_S)
                        wait = ra + rng.uniform(0, ra / 10)
                    elif last is None or last.ok or last.cancelled or not spec.backoff_s:
                        fails = 0
                        continue
                    elif time.perf_counter() - t0 - last.sent > spec.backoff_max_s:
                        continue  # a slow failure paced the user already
                    else:
                        cap = min(spec.backoff_max_s, spec.backoff_s * 2**fails)
                        fails += 1
                        wait = cap / 2 + rng.uniform(0, cap / 2)  # "equal jitter": bounded, never ~0
                    end = time.perf_counter() + wait
                    while (left := end - time.perf_counter()) > 0 and not sending_over():
                        await asyncio.sleep(min(left, 0.2))

            assert spec.concurrency is not None  # RunSpec.__post_init__: the closed loop has a concurrency
            tasks = {asyncio.create_task(user(u)) for u in range(spec.concurrency)}
        else:
            if spec.duration_s and spec.request_rate and spec.strategy != "trace":  # the clock ends the run
                jobs = itertools.islice(jobs, int(spec.request_rate * spec.duration_s * 3) + 100)
            job_list = list(jobs)
            if spec.strategy == "trace":
                offsets = [(items[job[0] % len(items)].at or 0.0) / spec.time_scale for job in job_list]
            else:
                assert spec.request_rate is not None  # RunSpec.__post_init__: open-loop strategies have a rate
                if spec.vllm_schedule:  # --compat vllm: the first after one gap, the n-th at n / rate
                    from distserve.distbench.vllm_compat import vllm_offsets

                    raw = schedule(spec.strategy, len(job_list) + 1, spec.request_rate, spec.burstiness, spec.seed)
                    offsets = vllm_offsets(raw, spec.request_rate)
                else:
                    offsets = schedule(spec.strategy, len(job_list), spec.request_rate, spec.burstiness, spec.seed)
            for job, off in zip(job_list, offsets):
                due = t0 + off
                if deadline is not None and due >= deadline:
                    break
                # plain sleeps (wait_for costs a task per send), at most 0.2 s each so a stop is seen soon
                while (delay := due - time.perf_counter()) > 0 and not stop.is_set():
                    await asyncio.sleep(min(delay, 0.2))
                if stop.is_set():
                    break
                task = asyncio.create_task(run_job(job, off))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        pending = {t for t in tasks if not t.done()}
        if pending:
            all_done = asyncio.ensure_future(asyncio.wait(pending))  # cancelling it cancels no request
            stop_wait = asyncio.ensure_future(stop.wait())
            waits = {all_done, stop_wait}
            if deadline is not None:
                waits.add(asyncio.ensure_future(asyncio.sleep(max(0.0, deadline - time.perf_counter()))))
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if not all_done.done():
                if not stop.is_set():  # the clock ended sending: drain, bounded, unless stopped meanwhile
                    if on_drain:
                        on_drain("duration reached", in_flight[0], spec.drain_s)
                    await asyncio.wait({all_done, stop_wait}, timeout=spec.drain_s, return_when=asyncio.FIRST_COMPLETED)
                if not all_done.done() and stop.is_set():
                    if on_drain:
                        on_drain("stopped", in_flight[0], spec.grace_s)
                    await asyncio.wait({all_done}, timeout=spec.grace_s)
                over[0] = True  # no user starts another request
                for t in pending:
                    t.cancel()  # a finished one ignores it; an unfinished one records `cancelled`
            for w in waits:
                w.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        return records, time.perf_counter() - t0, unix0
