#!/usr/bin/env python
"""Throughput of the CPU KV transports (tcp, shm) against a plain memory copy.

Usage: python -m bench.kv_transfer.kv_transfer_cpu [--sizes-mib 1 16 256] [--repeats 5] [--out FILE]

The sender (KVStagingServer) runs in a child process, the receiver (KVPuller) in this one, so
every pull crosses a real process boundary. For each payload size and transport it stages one
request, pulls it, and repeats; the pull's wall time (PULL, header, payload, crc32 verify, ACK, the
sender's DONE once the slot is unstaged) is what is reported, as GB/s = 1e9 bytes/s, median of the
repeats. The puller keeps its control connection open between pulls, as a decode worker does: the
first pull of each variant is a warm-up (not counted), the others reuse the connection. The JSON
also has each variant's phase medians (`KVPuller.last_timings`: connect_s, pull_to_header_s,
copy_s, ack_to_done_s) and how many pulls reused a connection. Staging time (the shm copy into a
fresh segment, the crc32) is reported separately: it is paid by the prefill worker, not on the
decode path. Baselines in the receiver process:
`dst.copy_(src)` (one thread, like the transports' copies) into a preallocated tensor (the memory-bandwidth ceiling)
and into a freshly allocated one (what a pull must do, page faults included).

"out" columns pull into a preallocated tensor reused across repeats (`pull(..., out=buf)`, what a
decode worker with memory ready does); the others allocate a fresh tensor per pull.

Payloads are float32 KV of shape [4 layers, 2, T tokens, 8 kv heads, 128 head dim] (32 KiB/token).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.lib.results import write_result
from distserve.server.kv_transfer import KVHandle, KVPuller, KVStagingServer

REPO = Path(__file__).resolve().parents[2]

MiB = 1 << 20
LAYERS, HEADS, HEAD_DIM = 4, 8, 128
# (transport, crc32 on, pull into a reused preallocated `out` tensor)
VARIANTS = [
    ("tcp", True, False),
    ("tcp", True, True),
    ("tcp", False, True),
    ("shm", True, False),
    ("shm", True, True),
    ("shm", False, True),
]
COLUMNS = ["memcpy warm", "memcpy fresh", "tcp", "tcp out", "tcp out nocrc", "shm", "shm out", "shm out nocrc"]


def variant_key(transport: str, checksum: bool, reuse_out: bool) -> str:
    return transport + ("_out" if reuse_out else "") + ("" if checksum else "_nocrc")


def kv_shape(nbytes: int) -> tuple[int, ...]:
    per_token = LAYERS * 2 * HEADS * HEAD_DIM * 4
    return (LAYERS, 2, nbytes // per_token, HEADS, HEAD_DIM)


def sender_main() -> None:
    """Child: stage on request, one JSON line in, one JSON line out."""
    tensors: dict[int, torch.Tensor] = {}
    with KVStagingServer(default_lease_ms=600_000) as srv:
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "quit":
                break
            nbytes = cmd["nbytes"]
            if nbytes not in tensors:
                tensors[nbytes] = torch.randn(kv_shape(nbytes))
            start = time.perf_counter()
            handle = srv.stage(cmd["rid"], tensors[nbytes], transport=cmd["transport"], checksum=cmd["checksum"])
            print(json.dumps({"handle": handle.to_dict(), "stage_s": time.perf_counter() - start}), flush=True)


def memcpy_s(nbytes: int, repeats: int, fresh: bool) -> list[float]:
    src = torch.randn(kv_shape(nbytes))
    dst = torch.empty_like(src)
    dst.copy_(src)
    out: list[float] = []
    for _ in range(repeats):
        start = time.perf_counter()
        if fresh:
            dst = torch.empty_like(src)
        dst.copy_(src)
        out.append(time.perf_counter() - start)
    return out


def gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def default_repeats(nbytes: int) -> int:
    return max(5, min(40, (512 * MiB) // max(nbytes, 1) // 8 * 5))


def run(sizes_mib: list[float], repeats_arg: int | None) -> dict[str, Any]:
    child = subprocess.Popen(
        [sys.executable, "-m", "bench.kv_transfer.kv_transfer_cpu", "--role", "sender"],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    stdin, stdout = child.stdin, child.stdout
    assert stdin is not None and stdout is not None  # both PIPE above
    try:
        assert json.loads(stdout.readline())["ready"]
        puller, seq = KVPuller(), 0
        rows: list[dict[str, Any]] = []

        def stage(nbytes: int, transport: str, checksum: bool) -> tuple[KVHandle, float]:
            nonlocal seq
            seq += 1
            stdin.write(
                json.dumps(
                    {"op": "stage", "rid": f"b{seq}", "nbytes": nbytes, "transport": transport, "checksum": checksum}
                )
                + "\n"
            )
            stdin.flush()
            reply = json.loads(stdout.readline())
            return KVHandle.from_dict(reply["handle"]), reply["stage_s"]

        for size in sizes_mib:
            nbytes = int(size * MiB)
            repeats = repeats_arg or default_repeats(nbytes)
            row: dict[str, Any] = {
                "size_mib": size,
                "nbytes": nbytes,
                "repeats": repeats,
                "memcpy_warm_s": memcpy_s(nbytes, repeats * 4, fresh=False),
                "memcpy_fresh_s": memcpy_s(nbytes, repeats * 4, fresh=True),
            }
            out = torch.empty(kv_shape(nbytes))
            for transport, checksum, reuse_out in VARIANTS:
                pulls: list[float] = []
                stages: list[float] = []
                phases: list[dict[str, Any]] = []
                for i in range(repeats + 1):  # the first one warms up
                    handle, stage_s = stage(nbytes, transport, checksum)
                    result = puller.pull(handle, timeout_s=120, out=out if reuse_out else None)
                    if not result.ok:
                        raise RuntimeError(f"pull failed: {result.error}")
                    timings = puller.last_timings
                    if timings is None:
                        raise RuntimeError("a successful pull left no timings")
                    if i:
                        pulls.append(result.seconds)
                        stages.append(stage_s)
                        phases.append(timings)
                    del result
                key = variant_key(transport, checksum, reuse_out)
                row[f"{key}_pull_s"], row[f"{key}_stage_s"] = pulls, stages
                row[f"{key}_phases_s_median"] = {
                    k: statistics.median(p[k] for p in phases) for k in phases[0] if k.endswith("_s")
                }
                row[f"{key}_reused_connection"] = sum(p["reused"] for p in phases)
            del out
            rows.append(row)
            print_row(row)
        stdin.write(json.dumps({"op": "quit"}) + "\n")
        stdin.flush()
        child.wait(timeout=30)
        puller.close()
    finally:
        if child.poll() is None:
            child.kill()
    return {
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
        },
        "unit": "GB/s = 1e9 bytes/s, median",
        "rows": rows,
    }


HEADER = " | ".join([f"{'size':>9}", *COLUMNS, "shm stage ms"])


def print_row(row: dict[str, Any]) -> None:
    n = row["nbytes"]
    keys = ["memcpy_warm_s", "memcpy_fresh_s", *(variant_key(*v) + "_pull_s" for v in VARIANTS)]
    cells = [f"{gbps(n, row[k]):>{len(c)}.2f}" for k, c in zip(keys, COLUMNS)]
    stage_ms = f"{statistics.median(row['shm_stage_s']) * 1e3:>12.1f}"
    print(" | ".join([f"{row['size_mib']:>5g} MiB", *cells, stage_ms]) + f"  (n={row['repeats']})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="example: python -m bench.kv_transfer.kv_transfer_cpu --out bench/results/kv_transfer_cpu.json",
    )
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 16, 256])
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="pulls per variant and size (default: 40 at <= 1 MiB down to 5 at "
        "256 MiB; small payloads are noisier on a shared machine)",
    )
    parser.add_argument("--out", help="write raw samples and medians as JSON to this file")
    parser.add_argument("--role", choices=["bench", "sender"], default="bench", help=argparse.SUPPRESS)
    args = parser.parse_args()
    # One intra-op thread in both processes: the transports copy on one thread (recv_into, a
    # memoryview copy), so that is the fair baseline; and with two processes on a small shared
    # machine, OpenMP workers waiting for a core turn a 1 MiB copy_ into milliseconds of noise.
    torch.set_num_threads(1)
    if args.role == "sender":
        sender_main()
        return
    print(
        "KV transfer throughput, GB/s (1e9 B/s), median of the repeats; sender and receiver in "
        "separate processes; crc32 on unless 'nocrc'; 'out' = pull into a preallocated tensor"
    )
    print(HEADER)
    print("-" * len(HEADER))
    report = run(args.sizes_mib, args.repeats)
    if args.out:
        write_result(args.out, report)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
