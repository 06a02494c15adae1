"""Streams completions at a server over the OpenAI API and records per-request timings.

Open loop (``request_rate``): send times are drawn in advance (Poisson, or gamma
with ``burstiness``) and TTFT is measured from the *scheduled* send time, so a
client that falls behind does not hide queueing (coordinated omission); the lag
is recorded. Closed loop (``concurrency``): each of N users sends its next
request when the previous one finishes.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field

import aiohttp


@dataclass
class RequestRecord:
    index: int
    scheduled: float  # seconds from the run's start
    sent: float
    ttft: float | None = None  # from the scheduled time
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft is not None

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tpot"] = self.tpot
        return d


@dataclass(frozen=True)
class LoadSpec:
    url: str
    num_prompts: int
    prompt_len: int = 128
    output_len: int = 64
    concurrency: int | None = None  # closed loop
    request_rate: float | None = None  # open loop, req/s
    burstiness: float = 1.0  # gamma shape; 1 = Poisson
    duration_s: float | None = None  # stop sending after this long
    seed: int = 0
    model: str | None = None
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.request_rate is None):
            raise ValueError("give exactly one of concurrency (closed loop) or request_rate (open loop)")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.request_rate is not None and self.request_rate <= 0:
            raise ValueError(f"request_rate must be > 0, got {self.request_rate}")
        if self.num_prompts < 1 or self.prompt_len < 1 or self.output_len < 1:
            raise ValueError("num_prompts, prompt_len and output_len must be >= 1")
        if self.burstiness <= 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")


def make_prompts(spec: LoadSpec) -> list[list[int]]:
    """Token-id prompts of exactly prompt_len tokens (ids 3..258: byte tokens of the tiny model)."""
    rng = random.Random(spec.seed)
    return [[rng.randrange(3, 259) for _ in range(spec.prompt_len)] for _ in range(spec.num_prompts)]


def schedule(spec: LoadSpec) -> list[float]:
    if spec.request_rate is None:
        return [0.0] * spec.num_prompts
    rng = random.Random(spec.seed + 1)
    t, out = 0.0, []
    for _ in range(spec.num_prompts):
        out.append(t)
        theta = 1.0 / (spec.request_rate * spec.burstiness)
        t += rng.gammavariate(spec.burstiness, theta)
    return out


async def _one(http: aiohttp.ClientSession, spec: LoadSpec, rec: RequestRecord, prompt: list[int],
               t_start: float) -> None:
    body = {"prompt": prompt, "max_tokens": spec.output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if spec.model:
        body["model"] = spec.model
    rec.prompt_tokens = len(prompt)
    sched_abs = t_start + rec.scheduled
    last = None
    try:
        async with http.post(f"{spec.url}/v1/completions", json=body) as r:
            if r.status != 200:
                rec.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                return
            async for raw in r.content:
                if not raw.startswith(b"data: ") or raw.startswith(b"data: [DONE]"):
                    continue
                data = json.loads(raw[6:])
                now = time.perf_counter()
                if "error" in data:
                    rec.error = data["error"].get("message", "error")
                    return
                if data.get("choices"):
                    if rec.ttft is None:
                        rec.ttft = now - sched_abs
                    elif last is not None:
                        rec.itl.append(now - last)
                    last = now
                elif data.get("usage"):
                    rec.output_tokens = data["usage"]["completion_tokens"]
        rec.e2e = time.perf_counter() - sched_abs
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        rec.error = f"{type(e).__name__}: {e}"


async def run_load(spec: LoadSpec, progress=None) -> tuple[list[RequestRecord], float]:
    prompts = make_prompts(spec)
    times = schedule(spec)
    records = [RequestRecord(i, times[i], 0.0) for i in range(spec.num_prompts)]
    timeout = aiohttp.ClientTimeout(total=spec.timeout_s)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        t_start = time.perf_counter()
        deadline = t_start + spec.duration_s if spec.duration_s else None

        async def fire(rec: RequestRecord) -> None:
            rec.sent = time.perf_counter() - t_start
            await _one(http, spec, rec, prompts[rec.index], t_start)
            if progress:
                progress()

        if spec.request_rate is not None:
            tasks = []
            for rec in records:
                delay = t_start + rec.scheduled - time.perf_counter()
                if deadline and t_start + rec.scheduled > deadline:
                    break
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(fire(rec)))
            await asyncio.gather(*tasks)
            records = records[: len(tasks)]
        else:
            queue = list(reversed(records))
            done: list[RequestRecord] = []

            async def user() -> None:
                while queue and not (deadline and time.perf_counter() > deadline):
                    rec = queue.pop()
                    rec.scheduled = time.perf_counter() - t_start  # closed loop: sent when due
                    await fire(rec)
                    done.append(rec)

            await asyncio.gather(*(user() for _ in range(spec.concurrency)))
            records = sorted(done, key=lambda r: r.index)
        return records, time.perf_counter() - t_start
