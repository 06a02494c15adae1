"""distbench's locustfile: each Locust user streams completions and keeps every raw timing.

Locust rounds its own percentiles (response times bucketed to 2 significant figures) and measures a
streamed request only to its headers; this user records TTFT, ITL and E2E of every request as a
``RequestRecord`` and, when the process quits, writes a distbench result (HDR histograms + records)
into ``out_dir``. ``distbench locust`` merges those files losslessly. Locust users are a closed loop.
Configuration comes from the environment variable ``DISTBENCH_LOCUST`` (JSON), set by ``distbench locust``.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import time
from pathlib import Path

from locust import HttpUser, constant, events, task
from locust.runners import MasterRunner

from distserve.distbench import result
from distserve.distbench.records import RequestRecord, short_error


class _Recorder:
    """This process's records (Locust's model is one module per process; this is its one piece of state)."""

    def __init__(self) -> None:
        self.cfg = json.loads(os.environ.get("DISTBENCH_LOCUST", "{}"))
        self.records: list[RequestRecord] = []
        self.counter = itertools.count()
        self.t0: float | None = None
        self.unix0 = 0.0

    def start(self) -> float:
        if self.t0 is None:
            self.t0, self.unix0 = time.perf_counter(), time.time()
        return self.t0


REC = _Recorder()


class CompletionUser(HttpUser):
    wait_time = constant(0)

    def on_start(self) -> None:
        self.rng = random.Random(REC.cfg.get("seed", 0) * 1000 + os.getpid() * 7 + id(self) % 997)

    @task
    def complete(self) -> None:
        cfg = REC.cfg
        t0 = REC.start()
        vocab = int(cfg.get("vocab_size", 259))
        prompt = [self.rng.randrange(3, vocab) for _ in range(int(cfg.get("prompt_len", 128)))]
        body = {
            "prompt": prompt,
            "max_tokens": int(cfg.get("output_len", 64)),
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if cfg.get("model"):
            body["model"] = cfg["model"]
        sent = time.perf_counter()
        rec = RequestRecord(next(REC.counter), sent - t0, sent - t0, REC.unix0 + (sent - t0), prompt_tokens=len(prompt))
        REC.records.append(rec)
        last: float | None = None
        try:
            with self.client.post(
                "/v1/completions", json=body, stream=True, catch_response=True, name="/v1/completions"
            ) as r:
                if r.status_code != 200:
                    rec.error = short_error(r.status_code, r.text)
                    r.failure(rec.error)
                    return
                for raw in r.iter_lines():
                    if not raw.startswith(b"data:"):
                        continue
                    line = raw[5:].strip()
                    if line == b"[DONE]":
                        break
                    now = time.perf_counter()
                    data = json.loads(line)
                    if "error" in data:
                        rec.error = f"stream error: {data['error']}"[:200]
                        r.failure(rec.error)
                        return
                    if data.get("usage"):
                        rec.output_tokens = int(data["usage"]["completion_tokens"])
                    if data.get("choices"):
                        if rec.ttft is None:
                            rec.ttft = rec.ttft_service = now - sent
                        elif last is not None:
                            rec.itl.append(now - last)
                        last = now
                if rec.ttft is None or last is None:
                    rec.error = "no tokens received"
                    r.failure(rec.error)
                    return
                rec.e2e = last - sent
                r.success()
        except Exception as e:  # noqa: BLE001 - a failed request is data
            rec.error = short_error(None, exc=e)


@events.quitting.add_listener
def _write(environment, **_kw) -> None:
    if isinstance(environment.runner, MasterRunner) or not REC.records or not REC.cfg.get("out_dir"):
        return
    dur = max(r.sent + (r.e2e or 0.0) for r in REC.records)
    res = result.build(
        REC.records,
        dur,
        REC.unix0,
        {
            "strategy": "closed",
            "concurrency": REC.cfg.get("users"),
            "endpoint": "/v1/completions",
            "model": REC.cfg.get("model"),
        },
        REC.cfg.get("percentiles", [50, 90, 95, 99, 99.9]),
        {},
        {},
    )
    result.save(res, Path(REC.cfg["out_dir"]) / f"locust-{os.getpid()}.json")
