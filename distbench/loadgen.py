"""The run loop: sends the workload at the strategy's times (open loop) or from N users (closed loop).

Open loop: send times are fixed in advance and TTFT/E2E are measured from the *scheduled* time (wrk2's
rule), so a client or server that falls behind cannot hide queueing; how late each send went out is
recorded (``sent - scheduled``). Closed loop: each user sends its next request when the previous one
finished (scheduled == sent). Multi-turn sessions run their turns in order; a later turn is due when
the previous one finished. ``stop`` (an asyncio.Event: Ctrl-C, --stop-on-saturation) ends sending; the
requests in flight get ``grace_s`` to finish, then are cancelled and recorded as failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import aiohttp

from distbench.client import body_for, send
from distbench.datasets import Item, Vocab
from distbench.records import RequestRecord
from distbench.sampling import DEFAULT as DEFAULT_SAMPLING
from distbench.sampling import sampling_fields
from distbench.strategies import schedule


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
    grace_s: float = 5.0
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
) -> tuple[list[RequestRecord], float, float]:
    """Returns (records in send order incl. warm-up, measured duration s, unix time of the start)."""
    stop = stop or asyncio.Event()
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
            async with gate:  # waiting here makes the send late: recorded, never hidden
                await send(
                    http, spec.url, spec.endpoint, body_for(spec.endpoint, it, spec.model, vocab, sampling), rec, t0
                )
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

        def new_rec(i: int, offset: float) -> RequestRecord:
            return RequestRecord(i, offset, start_unix=unix0 + offset)

        def sending_over() -> bool:
            return stop.is_set() or (deadline is not None and time.perf_counter() >= deadline)

        async def run_job(job: list[int], first_offset: float) -> None:
            offset = first_offset
            for k, i in enumerate(job):
                if k and sending_over():
                    return
                await one(i, new_rec(i, offset), t0)
                offset = time.perf_counter() - t0  # the next turn is due now

        if spec.strategy == "closed":

            async def user() -> None:
                while not sending_over():
                    job = next(jobs, None)
                    if job is None:
                        return
                    await run_job(job, time.perf_counter() - t0)

            assert spec.concurrency is not None  # RunSpec.__post_init__: the closed loop has a concurrency
            tasks = {asyncio.create_task(user()) for _ in range(spec.concurrency)}
        else:
            if spec.duration_s and spec.request_rate and spec.strategy != "trace":  # the clock ends the run
                jobs = itertools.islice(jobs, int(spec.request_rate * spec.duration_s * 3) + 100)
            job_list = list(jobs)
            if spec.strategy == "trace":
                offsets = [(items[job[0] % len(items)].at or 0.0) / spec.time_scale for job in job_list]
            else:
                assert spec.request_rate is not None  # RunSpec.__post_init__: open-loop strategies have a rate
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
        pending = set(tasks)
        if pending:
            all_done = asyncio.ensure_future(asyncio.wait(pending))  # cancelling it cancels no request
            stop_wait = asyncio.ensure_future(stop.wait())
            await asyncio.wait({all_done, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
            stop_wait.cancel()
            if not all_done.done():  # stopped: in-flight requests get grace_s, then are cancelled
                all_done.cancel()
                _, late = await asyncio.wait(pending, timeout=spec.grace_s)
                for t in late:
                    t.cancel()
                await asyncio.gather(*late, return_exceptions=True)
        return records, time.perf_counter() - t0, unix0
