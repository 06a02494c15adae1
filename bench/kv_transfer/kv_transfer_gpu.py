"""cuda_ipc KV pull between two processes vs a device-to-device copy of the same bytes.

The payload is the KV of one 2048-token Llama-2-7B request: 32 layers x 2 x 2048 tokens x 32 heads
x 128 x bf16 = 1 GiB. The sender (this process) stages it with `KVStagingServer`
(transport cuda_ipc); a receiver process pulls it with `KVPuller(cuda_device=DST)`, timing each
`pull()` end to end (PULL -> IPC description, open, copy, sync, ACK -> the sender's DONE). The
puller keeps its control connection open between pulls, as a decode worker does, so every pull but
the first of a path reuses it. Paths: the staging pool (the receiver keeps its mapping of the pool; also
with the destination preallocated by the receiver, as a decode worker can pass `out=`
between pulls) and the per-transfer export (the receiver opens and closes the mapping every pull).
The baseline is `dst.copy_(src)` of the same size inside the receiver (same source and destination
GPUs), wall time with a synchronize and CUDA-event time. Target: pull throughput >= 50% of that
copy's.

The first pull of each path is a warm-up reported apart (it connects to that path's sender and opens
the pool mapping); medians are over the rest. Phases (`KVPuller.last_timings`, medians over the
same pulls): connect_s (pool lookup on a reused connection), pull_to_header_s, copy_s (open, copy,
sync) and ack_to_done_s. Correctness: the receiver compares an int64 sum and a few sampled slices
with the sender's.

Then sustained transfer: 8 pulls back to back on one connection (no idle gap), and 8 pulls from 4
threads at once (each its own connection and stream), as a decode worker under load has several
pulls in flight; bytes moved / wall time of the round, median of 3 rounds.

Usage (device): python3 -m bench.kv_transfer.kv_transfer_gpu --out $OUT/kv_transfer_gpu.json [--dst cuda:1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import torch

from bench.lib.results import write_result

REPO = Path(__file__).resolve().parents[2]

SHAPE = (32, 2, 2048, 32, 128)
TARGET_FRACTION = 0.5

_CHILD = textwrap.dedent("""
    import json, statistics, sys, time, torch
    from distserve.server.kv_transfer import KVHandle, KVPuller
    dst = sys.argv[1]
    puller = KVPuller(cuda_device=dst)
    prealloc = {}
    def digest(t):
        f = t.view(torch.int16)
        return [int(f.sum(dtype=torch.int64)), int(f[1, 1, 77].sum(dtype=torch.int64)),
                int(f[-1, 0, -1].sum(dtype=torch.int64))]
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "copy":
            src = torch.empty(req["nbytes"], dtype=torch.uint8, device=req["src"])
            out = torch.empty(req["nbytes"], dtype=torch.uint8, device=dst)
            walls, events = [], []
            for i in range(req["iters"] + 2):
                torch.cuda.synchronize(src.device); torch.cuda.synchronize(out.device)
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0 = time.perf_counter(); a.record()
                out.copy_(src)
                b.record(); b.synchronize(); torch.cuda.synchronize(src.device)
                if i >= 2:
                    walls.append(time.perf_counter() - t0); events.append(a.elapsed_time(b) / 1e3)
            print(json.dumps({"wall_s": walls, "event_s": events}), flush=True)
            continue
        if req["op"] == "pull_many":  # all at once: `threads` pullers, each on its own connection
            from concurrent.futures import ThreadPoolExecutor
            hs = [KVHandle.from_dict(d) for d in req["handles"]]
            def one(h):
                t = time.perf_counter(); r = puller.pull(h, 30); dt = time.perf_counter() - t
                ok = r.ok; del r
                return ok, dt
            t0 = time.perf_counter()
            with ThreadPoolExecutor(req["threads"]) as ex:
                got = list(ex.map(one, hs))
            print(json.dumps({"wall_s": time.perf_counter() - t0, "ok": all(g[0] for g in got),
                              "pull_s": [g[1] for g in got]}), flush=True)
            continue
        h = KVHandle.from_dict(req["handle"])
        dst_t = None
        if req.get("prealloc"):  # a decode worker can pass memory it already has (`out=`)
            dst_t = prealloc.get(h.shape)
            if dst_t is None:
                dst_t = prealloc[h.shape] = torch.empty(h.shape, dtype=h.torch_dtype, device=dst)
        t0 = time.perf_counter()
        r = puller.pull(h, 30, out=dst_t)
        dt = time.perf_counter() - t0
        res = {"status": r.status.value, "error": r.error, "s": dt, "phases": puller.last_timings}
        if r.ok and req.get("check"):
            res["digest"] = digest(r.tensor)
        del r
        print(json.dumps(res), flush=True)
""")


def digest(t: torch.Tensor) -> list[int]:
    f = t.view(torch.int16)
    return [
        int(f.sum(dtype=torch.int64)),
        int(f[1, 1, 77].sum(dtype=torch.int64)),
        int(f[-1, 0, -1].sum(dtype=torch.int64)),
    ]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", default="cuda:0")
    ap.add_argument("--dst", default="cuda:0")
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out_path = Path(args.out or Path(os.environ.get("OUT", ".")) / "kv_transfer_gpu.json")

    from distserve.server.kv_transfer import KVStagingServer

    res: dict[str, Any] = {
        "shape": SHAPE,
        "dtype": "bfloat16",
        "src": args.src,
        "dst": args.dst,
        "target_fraction_of_d2d": TARGET_FRACTION,
        "env": {
            "gpu": torch.cuda.get_device_name(0),
            "torch": torch.__version__,
            "gpus": torch.cuda.device_count(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        },
        "errors": {},
    }

    def save() -> None:
        write_result(out_path, res)

    kv = (torch.randn(SHAPE, device=args.src, dtype=torch.float32) * 0.5).to(torch.bfloat16)
    nbytes = kv.numel() * kv.element_size()
    res["nbytes"] = nbytes
    want = digest(kv)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, args.dst],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
    )
    stdin, stdout = child.stdin, child.stdout
    assert stdin is not None and stdout is not None  # both PIPE above

    def ask(req: dict[str, Any]) -> dict[str, Any]:
        stdin.write(json.dumps(req) + "\n")
        stdin.flush()
        line = stdout.readline()
        if not line:
            raise RuntimeError(f"receiver died (exit {child.poll()})")
        return json.loads(line)

    try:
        copy = ask({"op": "copy", "src": args.src, "nbytes": nbytes, "iters": 10})
        d2d_wall = statistics.median(copy["wall_s"])
        d2d_event = statistics.median(copy["event_s"])
        res["d2d_copy"] = {
            "wall_s_median": d2d_wall,
            "event_s_median": d2d_event,
            "GBps_wall": nbytes / d2d_wall / 1e9,
            "GBps_event": nbytes / d2d_event / 1e9,
            "note": "one-way bytes per second (bytes read + written is twice this)",
        }
        print(
            f"d2d copy {args.src}->{args.dst}: {d2d_wall * 1e3:.3f} ms wall, {nbytes / d2d_wall / 1e9:.0f} GB/s",
            flush=True,
        )
        save()
        for name, pool_bytes, prealloc in (
            ("pool", 2 * nbytes, False),
            ("pool_into_prealloc", 2 * nbytes, True),
            ("own_export", 0, False),
        ):
            with KVStagingServer(cuda_ipc_pool_bytes=pool_bytes, default_lease_ms=60_000) as srv:
                times: list[float] = []
                stage_s: list[float] = []
                phases: list[dict[str, Any]] = []
                ok = True
                for i in range(args.repeats):
                    payload = kv if pool_bytes else kv.clone()  # an own export hands its tensor over
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    h = srv.stage(f"{name}-{i}", payload, transport="cuda_ipc")
                    del payload
                    stage_s.append(time.perf_counter() - t0)
                    check = i in (0, args.repeats - 1)
                    r = ask({"op": "pull", "handle": h.to_dict(), "check": check, "prealloc": prealloc})
                    if r["status"] != "success":
                        ok = False
                        res["errors"][f"{name}-{i}"] = r["error"]
                        break
                    if check and r["digest"] != want:
                        ok = False
                        res["errors"][f"{name}-{i}"] = f"digest {r['digest']} != {want}"
                    times.append(r["s"])
                    phases.append(r.get("phases") or {})
                    time.sleep(0.05)  # let the sender's freeing thread release the entry (after DONE)
                rest = times[1:] or times
                med = statistics.median(rest) if rest else float("nan")
                timed = phases[1:] or phases
                phase_keys = [k for k in (timed[-1] if timed else {}) if k.endswith("_s")]
                res[f"cuda_ipc_{name}"] = {
                    "correct": ok,
                    "pulls": len(times),
                    "first_pull_s": times[0] if times else None,
                    "pull_s_median": med,
                    "pull_s_min": min(rest) if rest else None,
                    "pull_s_all": times,
                    "stage_s_median": statistics.median(stage_s) if stage_s else None,
                    "GBps": nbytes / med / 1e9,
                    "fraction_of_d2d_wall": d2d_wall / med,
                    "meets_target": bool(ok and d2d_wall / med >= TARGET_FRACTION),
                    "phases_s_median": {k: statistics.median(p[k] for p in timed if k in p) for k in phase_keys},
                    "first_pull_phases": phases[0] if phases else None,
                    "pulls_on_reused_connection": sum(bool(p.get("reused")) for p in timed),
                }
                print(
                    f"cuda_ipc {name}: pull {med * 1e3:.3f} ms median (first {times[0] * 1e3:.2f} ms), "
                    f"{nbytes / med / 1e9:.0f} GB/s = {d2d_wall / med:.0%} of the d2d copy; "
                    f"correct={ok}; phases (ms) "
                    + ", ".join(
                        f"{k[:-2]} {v * 1e3:.3f}" for k, v in res[f"cuda_ipc_{name}"]["phases_s_median"].items()
                    )
                    + f"; {res[f'cuda_ipc_{name}']['pulls_on_reused_connection']}/{len(timed)} on a reused "
                    "connection",
                    flush=True,
                )
                save()
        # Sustained transfer: N pulls back to back (no idle gap), and N pulls from `threads` threads
        # at once (a decode worker under load has several KV pulls in flight).
        for label, n, threads in (("back_to_back", 8, 1), ("concurrent_4", 8, 4)):
            with KVStagingServer(cuda_ipc_pool_bytes=(n + 1) * nbytes, default_lease_ms=60_000) as srv:
                warm = srv.stage(f"{label}-warm", kv, transport="cuda_ipc")
                ask({"op": "pull_many", "handles": [warm.to_dict()], "threads": threads})
                rounds: list[dict[str, Any]] = []
                for rnd in range(3):
                    hs = [srv.stage(f"{label}-{rnd}-{i}", kv, transport="cuda_ipc").to_dict() for i in range(n)]
                    torch.cuda.synchronize()
                    r = ask({"op": "pull_many", "handles": hs, "threads": threads})
                    if not r["ok"]:
                        res["errors"][label] = "a pull failed"
                        break
                    rounds.append(r)
                    time.sleep(0.05)
                if rounds:
                    wall = statistics.median(r["wall_s"] for r in rounds)
                    res[f"cuda_ipc_pool_{label}"] = {
                        "pulls_per_round": n,
                        "threads": threads,
                        "rounds": len(rounds),
                        "round_wall_s_median": wall,
                        "GBps": n * nbytes / wall / 1e9,
                        "fraction_of_d2d_wall": (n * nbytes / wall) / (nbytes / d2d_wall),
                        "pull_s_median": statistics.median(x for r in rounds for x in r["pull_s"]),
                    }
                    print(
                        f"cuda_ipc pool {label}: {n} pulls x 1 GiB in {wall * 1e3:.2f} ms = "
                        f"{n * nbytes / wall / 1e9:.0f} GB/s = "
                        f"{res[f'cuda_ipc_pool_{label}']['fraction_of_d2d_wall']:.0%} of the d2d copy",
                        flush=True,
                    )
                save()
    except Exception as e:  # keep what was measured
        res["errors"]["run"] = f"{type(e).__name__}: {e}"
        print(res["errors"]["run"], flush=True)
    finally:
        try:
            stdin.close()
            child.wait(30)
        except Exception:
            child.kill()
        save()
    return 0 if not res["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
