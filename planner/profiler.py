"""``distserve profile``: measure a profile through the real engine on the target device.

- prefill: one engine step over B prompts of L new tokens (all admitted in one step), per (B, L);
- decode: one step of B running sequences of C tokens of context, per (B, C);
- KV transfer: a real ``KVStagingServer`` and ``KVPuller`` over loopback (tcp, or shm on one host), one pull
  of a tensor of the engine's KV shape per size (the decode side's pull time, connection reused);
- CPU only, the thread split: the same prefill and decode steps with T torch threads, alone and with a
  neighbour process stepping a decode batch on the other cores (what co-located workers do to each other).
Each point is the minimum of a few repeats (on a shared machine, the step undisturbed by other users); the
default sweep is short (about a minute with the tiny model on two busy cores; ``--quick``: two points a phase).
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import torch

from distserve.planner.profile import DecodePoint, PrefillPoint, Profile, ThreadPoint, TransferPoint


@dataclass(frozen=True)
class Sweep:
    prefill: tuple[tuple[int, int], ...]
    decode: tuple[tuple[int, int], ...]
    kv_tokens: tuple[int, ...]
    repeats: int
    decode_steps: int


CPU_SWEEP = Sweep(
    prefill=((1, 32), (1, 128), (1, 512), (4, 128)),
    decode=((1, 128), (8, 128), (32, 128), (8, 512)),
    kv_tokens=(16, 128, 512, 2048),
    repeats=3,
    decode_steps=8,
)
QUICK_CPU_SWEEP = Sweep(
    prefill=((1, 128), (1, 1024)), decode=((1, 128), (16, 256)), kv_tokens=(128, 1024), repeats=2, decode_steps=4
)
GPU_SWEEP = Sweep(
    prefill=((1, 128), (1, 512), (1, 2048), (2, 2048), (8, 128)),
    decode=((1, 128), (16, 512), (64, 1024), (128, 1024)),
    kv_tokens=(128, 512, 2048),
    repeats=5,
    decode_steps=16,
)


def _prompt(i: int, n: int, salt: int) -> list[int]:
    # distinct prompts, so prefix caching never skips work
    return [1] + [(7 * i + 13 * j + 31 * salt) % 250 + 3 for j in range(n - 1)]


class EngineProbe:
    """Times single steps of one engine (the real scheduler, runner and sampler)."""

    def __init__(
        self, model: str | None, device: str, threads: int = 0, max_len: int = 4096, num_blocks: int = 0
    ) -> None:
        from distserve.server.engine.llm_engine import EngineConfig, LLMEngine

        self.engine = LLMEngine(
            EngineConfig(
                model=model,
                device=device,
                max_num_seqs=256,
                max_num_batched_tokens=16384,
                max_model_len=max_len,
                enable_prefix_caching=False,
                torch_threads=threads,
                num_blocks=num_blocks,  # 0: kv_cache_memory_mb's default
            )
        )
        self.device = device
        self._salt = 0

    def _sync(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()

    def _params(self, n: int):
        from distserve.server.engine.sampling_params import SamplingParams

        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    def kv_bytes_per_token(self) -> int:
        shape = self.engine.runner.kv_shape(1)
        n = 1
        for s in shape:
            n *= s
        return n * torch.empty((), dtype=self.engine.dtype).element_size()

    def prefill_ms(self, batch: int, tokens: int, repeats: int) -> float:
        out = []
        for r in range(repeats + 1):
            self._salt += 1
            for i in range(batch):
                self.engine.add_request(f"p{self._salt}-{i}", _prompt(i, tokens, self._salt), self._params(1))
            self._sync()
            t0 = time.perf_counter()
            self.engine.step()
            self._sync()
            dt = time.perf_counter() - t0
            while self.engine.has_unfinished_requests():
                self.engine.step()
            if r:
                out.append(dt * 1000)
        return min(out)

    def decode_ms(self, batch: int, context: int, steps: int, repeats: int) -> float:
        """The fastest of ``repeats`` windows of ``steps`` decode steps, all on one batch prefilled once (the
        prefill of the context is most of a decode point's cost on a CPU); the context grows by ``steps`` per
        window, so the point's context is ``context`` + half the tokens decoded (``decode_context``)."""
        self._salt += 1
        total = steps * (repeats + 1)
        for i in range(batch):
            self.engine.add_request(f"d{self._salt}-{i}", _prompt(i, context, self._salt), self._params(total + 2))
        while any(s.is_prefill for s in self.engine.requests.values()):
            self.engine.step()
        out = []
        for r in range(repeats + 1):
            self._sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                self.engine.step()
            self._sync()
            if r:  # the first window warms up
                out.append((time.perf_counter() - t0) / steps * 1000)
        while self.engine.has_unfinished_requests():
            self.engine.step()
        return min(out)


def decode_context(context: int, sweep: Sweep) -> int:
    """The mean context of a decode point's timed windows (see ``EngineProbe.decode_ms``)."""
    return context + sweep.decode_steps * (sweep.repeats + 1) // 2


def measure_kv(
    kv_shape_of, dtype: torch.dtype, tokens: tuple[int, ...], transport: str, repeats: int
) -> list[TransferPoint]:
    """Pull times over a real sender/receiver pair on loopback (the decode side's view: PULL to DONE)."""
    from distserve.server.kv_transfer import KVPuller, KVStagingServer

    points = []
    with KVStagingServer(default_lease_ms=600_000) as srv:
        puller = KVPuller()
        try:
            for n in tokens:
                t = torch.randn(kv_shape_of(n)).to(dtype)
                times = []
                for r in range(repeats + 1):
                    handle = srv.stage(f"kv{n}-{r}", t, transport=transport)
                    res = puller.pull(handle)
                    if res.tensor is None:
                        raise RuntimeError(f"KV pull failed while profiling: {res.error}")
                    if r:
                        times.append(res.seconds * 1000)
                points.append(
                    TransferPoint(
                        t.numel() * t.element_size(),
                        statistics.median(times),
                        "measured",
                        f"{transport}, {n} tokens, loopback",
                    )
                )
        finally:
            puller.close()
    return points


def _neighbour_main(model: str | None) -> None:
    """A neighbour process: once told "go" on stdin, steps a decode batch with one thread until stdin closes."""
    torch.set_num_threads(1)
    probe = EngineProbe(model, "cpu", threads=1)
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    import select

    while not select.select([sys.stdin], [], [], 0)[0]:
        probe.decode_ms(16, 128, 4, 1)


THREADS_LEGEND = (
    "thread split: step time with T torch threads, relative to 1 thread alone (x0.50 = twice as fast, x2.00 = "
    "twice as slow); neighbours 1 = another worker busy on the other cores (what a prefill and a decode worker "
    "sharing this machine do to each other); the planner scales its step times by these"
)


def measure_threads(model: str | None, repeats: int, log, settle=lambda: None) -> list[ThreadPoint]:
    """Prefill (1 x 128) and decode (8 x 128) steps with T threads, alone and beside one neighbour.

    Ratios of minimums over the repeats: on a shared machine the minimum is the step undisturbed by other
    users' processes, so the ratio isolates what the thread count and the neighbour do. The neighbour process
    starts first and waits (its torch import overlaps ``settle``, e.g. the serving measurement's shutdown);
    nothing is timed before ``settle()`` returned and the neighbour is ready."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    child = None
    if cpus > 1:
        child = subprocess.Popen(
            [sys.executable, "-m", "distserve.planner.profiler", "--neighbour"],
            env={**os.environ, "DISTSERVE_PROFILE_MODEL": model or ""},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
    base: dict[str, float] = {}
    points = []
    log(THREADS_LEGEND)
    try:
        settle()
        if child is not None:
            assert child.stdout is not None
            if child.stdout.readline().strip() != "ready":
                raise RuntimeError("the neighbour process of the thread-split measurement did not start")
        for neighbours in (0, 1) if child is not None else (0,):
            if neighbours and child is not None:
                assert child.stdin is not None
                child.stdin.write("go\n")
                child.stdin.flush()
            for threads in sorted({1, cpus - neighbours} - {0}):
                torch.set_num_threads(threads)
                probe = EngineProbe(model, "cpu", threads=threads)
                pf = probe.prefill_ms(1, 128, 1)
                # many times slower (threads spinning on cores other users hold): clear at once, and each
                # further repeat would cost seconds, so it is not repeated
                slow = bool(base) and pf > 3 * base["prefill"]
                if not slow:
                    pf = min(pf, probe.prefill_ms(1, 128, repeats))
                dc = probe.decode_ms(8, 128, 2, 1) if slow else probe.decode_ms(8, 128, 4, repeats + 1)
                if not base:
                    base = {"prefill": pf, "decode": dc}
                # a neighbour cannot make a step faster: a ratio below 1 is noise in the base, kept at 1
                floor = 1.0 if neighbours else 0.0
                points += [
                    ThreadPoint("prefill", threads, neighbours, max(floor, pf / base["prefill"])),
                    ThreadPoint("decode", threads, neighbours, max(floor, dc / base["decode"])),
                ]
                log(
                    f"threads {threads}, neighbours {neighbours}: prefill x{pf / base['prefill']:.2f}, "
                    f"decode x{dc / base['decode']:.2f}"
                )
    finally:
        if child is not None:
            assert child.stdin is not None
            child.stdin.close()
            child.wait(timeout=30)
    torch.set_num_threads(1)
    return points


def measure_serving(
    model: str | None, device: str, prefill_128_ms: float, kv_128_ms: float, decode_1_ms: float, log
) -> tuple[float, float, threading.Thread]:
    """(overhead_ttft_ms, handoff_ms, stopping) from a real ``distserve serve`` (1 prefill + 1 decode worker)
    sent 8 requests one at a time (128-token prompt, 2 output tokens, distbench in this process): the TTFT
    beyond the prefill step, and the one TPOT gap beyond the KV pull and a decode step (router -> decode
    worker, reservation, scatter, stream). The server stops (by PID, gracefully: a few seconds) in the
    returned thread, so the caller can overlap that wait with work that is not timed; join it."""
    import tempfile
    from pathlib import Path

    from distserve.distbench.loadgen import RunSpec
    from distserve.distbench.runner import Options, Workload
    from distserve.distbench.runner import run as run_distbench
    from distserve.distbench.target import ServeProcess

    tmp = tempfile.TemporaryDirectory(prefix="distserve-profile-")
    cfg = {"router": {"port": 0}, **({"model": model} if model else {})}
    extra = [] if device == "cpu" else ["--device", device]
    srv = ServeProcess(Path(tmp.name) / "serve", config=cfg, extra_args=extra)

    def stop() -> None:
        try:
            srv.stop()
        finally:
            tmp.cleanup()

    stopping = threading.Thread(target=stop, name="profile-serve-stop")
    try:
        spec = RunSpec(url=srv.url, strategy="closed", concurrency=1, num_prompts=8, warmup=2, timeout_s=120.0)
        res = run_distbench(Options(spec, Workload(prompt_len="128", output_len="2"), progress=False, token=srv.token))
        recs = [r for r in res["requests"] if not r.get("warmup") and not r.get("error")]
    except Exception as e:  # noqa: BLE001 - the profile stays usable without the serving path
        log(f"serving measurement failed ({type(e).__name__}: {e}): overhead and hand-off left at 0")
        recs = []
    stopping.start()
    if not recs:
        log("serving measurement: no request succeeded; overhead and hand-off left at 0")
        return 0.0, 0.0, stopping
    ttft = statistics.median(r["ttft"] * 1000 for r in recs)
    gaps = [r["tpot"] * 1000 for r in recs if r.get("tpot")]
    gap = statistics.median(gaps) if gaps else 0.0
    overhead = max(0.0, ttft - prefill_128_ms)
    handoff = max(0.0, gap - kv_128_ms - decode_1_ms) if gaps else 0.0
    log(
        f"serving path: TTFT {ttft:.1f} ms (+{overhead:.1f} over the prefill step), first decode gap {gap:.1f} ms "
        f"(hand-off {handoff:.1f} ms beyond the pull and a step)"
    )
    return overhead, handoff, stopping


def measure(
    model: str | None,
    device: str,
    sweep: Sweep | None = None,
    transport: str = "tcp",
    threads: bool = True,
    serving: bool = True,
    log=print,
) -> Profile:
    on_cpu = device == "cpu"
    sweep = sweep or (CPU_SWEEP if on_cpu else GPU_SWEEP)
    if on_cpu:
        torch.set_num_threads(1)  # the base of every point: one thread, as the launcher gives a worker of 2 cores
    probe = EngineProbe(model, device, threads=1 if on_cpu else 0)
    prefill, decode = [], []
    for b, n in sweep.prefill:
        ms = probe.prefill_ms(b, n, sweep.repeats)
        prefill.append(PrefillPoint(b, n, ms))
        log(f"prefill {b} x {n}: {ms:.2f} ms")
    for b, c in sweep.decode:
        ms = probe.decode_ms(b, c, sweep.decode_steps, sweep.repeats)
        decode.append(DecodePoint(b, decode_context(c, sweep), ms))
        log(f"decode {b} x {c}: {ms:.2f} ms")
    kvb = probe.kv_bytes_per_token()
    kv = measure_kv(probe.engine.runner.kv_shape, probe.engine.dtype, sweep.kv_tokens, transport, sweep.repeats)
    for p in kv:
        log(f"kv {p.bytes / 2**20:.1f} MiB: {p.ms:.2f} ms")
    # the serving path's references: a 1 x 128 prefill, a 128-token pull and a batch-1 decode step (reused
    # from the sweep when it has them)
    p128 = next((p.ms for p in prefill if (p.batch, p.tokens) == (1, 128)), None)
    if p128 is None:
        p128 = probe.prefill_ms(1, 128, sweep.repeats)
    kv128 = next((p.ms for p, n in zip(kv, sweep.kv_tokens, strict=True) if n == 128), None)
    if kv128 is None:
        kv128 = measure_kv(probe.engine.runner.kv_shape, probe.engine.dtype, (128,), transport, sweep.repeats)[0].ms
    d1 = decode[0].ms
    del probe
    stopping: threading.Thread | None = None
    if serving:
        overhead, handoff, stopping = measure_serving(model, device, p128, kv128, d1, log)
    else:
        overhead, handoff = (5.0 if on_cpu else 2.0), 0.0
    settle = stopping.join if stopping is not None else (lambda: None)
    tpoints = measure_threads(model, 1, log, settle) if (threads and on_cpu) else []
    settle()
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if on_cpu:
        name = f"{cpus}-vCPU {platform.machine()}"
        count = cpus
    else:
        name = torch.cuda.get_device_name(torch.device(device))
        count = torch.cuda.device_count()
    return Profile(
        device="cpu" if on_cpu else "cuda",
        device_name=name,
        model=model or "",
        kv_bytes_per_token=kvb,
        devices_available=count,
        transport=transport,
        prefill=tuple(prefill),
        decode=tuple(decode),
        kv_transfer=tuple(kv),
        threads=tuple(tpoints),
        overhead_ttft_ms=overhead,
        handoff_ms=handoff,
        notes=(
            f"measured by distserve profile on {name}, torch {torch.__version__}, "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
            "every point: one engine step (minimum of repeats), one torch thread per process on CPU",
            "overhead_ttft_ms, handoff_ms: a real 1P1D distserve serve, 8 requests one at a time"
            if serving
            else "overhead_ttft_ms: not measured (--no-serving), router + HTTP from docs/performance/serving-cpu.md; "
            "handoff_ms: not measured",
        ),
    )


if __name__ == "__main__":
    if "--neighbour" in sys.argv:
        _neighbour_main(os.environ.get("DISTSERVE_PROFILE_MODEL") or None)
