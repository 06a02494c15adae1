"""Where the host CPU goes per request: CPU milliseconds per request, and the share of one core, of every process
of a serving path (the router, each worker, the distbench client), over an open-loop sweep; optionally a py-spy
profile of each server process during one point.

Why: a layout's TTFT tail can come from a saturated Python process rather than the GPU (the router relays every
token event; the prefill worker parses, schedules and samples token 1 for every request). A process near 100 % of
one core is the bottleneck whatever the GPU does, and its queueing shows first in TTFT.

For each of ``--layouts`` (names as in ``gpu_sm_split``: ``colocated@N``, ``1p1d``, ``LABEL:P:D``, ``+ref``) start
``distserve serve``, send ``--prewarm`` requests, then per rate of ``--rates`` one distbench point (``--num-prompts``
requests, ``--workload``, ``--sampling``). Each point reads ``utime + stime`` of every process under the server
(``/proc``) and of this process (the client) before and after. With ``--pyspy`` (py-spy on the PATH or in the
environment) each server process is sampled during the point at ``--rates``' last rate and the JSON keeps, per
process, the busy share and the top frames by inclusive and by self time (idle waits removed).

Device (carry ``.whl``, which may hold py-spy's wheel): ``bash bench/serving/cpu_per_request_run.sh``.
CPU: ``python -m bench.serving.cpu_per_request --device cpu --model '' --layouts 1p1d --rates 10 --num-prompts 150``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.lib.results import write_result
from bench.serving.gpu_sm_split import KEEP, SLO, layout_args, scrape, workload
from distserve.distbench.loadgen import RunSpec
from distserve.distbench.runner import Options
from distserve.distbench.runner import run as run_distbench
from distserve.distbench.target import ServeProcess
from distserve.server.launcher import process_cpu_s

# leaf frames of a thread that waits (py-spy reports waiting threads too)
IDLE_LEAVES = ("select (", "epoll", "poll (", "_worker (concurrent", "wait (threading", "sleep", "_run_once (asyncio")


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            continue
        kids.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(p))
    return kids


def role_of(cmdline: str) -> str:
    """router / prefill / decode / colocated / serve / other, from a ``distserve`` command line."""
    words = cmdline.split()
    if "--role" in words and words.index("--role") + 1 < len(words):
        return words[words.index("--role") + 1]
    for name in ("router", "serve"):
        if name in words:
            return name
    return "other"


def cpu_tree(pid: int) -> dict[int, tuple[float, str]]:
    """pid -> (CPU seconds so far, role) of ``pid`` and every descendant."""
    kids, out, stack = _children(), {}, [pid]
    while stack:
        q = stack.pop()
        cpu = process_cpu_s(q)  # the launcher's reader of /proc/PID/stat
        try:
            cmd = Path(f"/proc/{q}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if cpu is not None:
            out[q] = (cpu, role_of(cmd))
        stack += kids.get(q, [])
    return out


def self_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def aggregate_pyspy(raw: str, top: int = 60) -> dict:
    """py-spy's raw (collapsed) stacks -> busy share and the top frames by inclusive and self samples."""
    incl: collections.Counter[str] = collections.Counter()
    leaf: collections.Counter[str] = collections.Counter()
    total = idle = 0
    for line in raw.splitlines():
        stack, _, n_text = line.rstrip().rpartition(" ")
        if not stack or not n_text.isdigit():
            continue
        n = int(n_text)
        frames = stack.split(";")
        total += n
        if any(k in frames[-1] for k in IDLE_LEAVES):
            idle += n
            continue
        leaf[frames[-1]] += n
        for f in set(frames):
            incl[f] += n
    busy = max(total - idle, 1)
    return {
        "samples": total,
        "busy_share": round((total - idle) / total, 3) if total else None,
        # frames on (nearly) every busy stack (the loop, the thread bootstrap) say nothing: left out
        "inclusive_of_busy": [[f, round(n / busy, 3)] for f, n in incl.most_common(top + 20) if n < 0.97 * busy][:top],
        "self_of_busy": [[f, round(n / busy, 3)] for f, n in leaf.most_common(top)],
    }


@dataclass
class Journal:
    """The router's request journal of one server, read on from ``offset`` at each point."""

    path: Path
    offset: int = 0


def journal_parts(path: Path, offset: int) -> tuple[dict, int]:
    """The router journal's lines from ``offset``: TTFT parts (decode-room wait, the call that returned token 1,
    the rest) averaged over all requests and over the slowest tenth, in ms; and the new offset."""
    if not path.exists():
        return {"error": "no journal"}, offset
    with path.open("rb") as f:
        f.seek(offset)
        data = f.read()
    rows = []
    for line in data.decode(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        parts = (rec.get("ttft_parts") or {}).get("measured")
        if rec.get("kind") == "request" and rec.get("ttft") is not None and parts:
            rows.append((rec["ttft"], parts, (rec.get("ttft_parts") or {}).get("predicted")))
    if not rows:
        return {"requests": 0}, offset + len(data)
    rows.sort(key=lambda r: r[0])

    def mean_ms(sel: list, i: int) -> float:
        return round(sum(r[1][i] for r in sel) / len(sel) * 1000, 2)

    slow = rows[-max(len(rows) // 10, 1) :]
    out: dict = {"requests": len(rows)}
    for name, sel in (("all", rows), ("slowest_tenth", slow)):
        out[name] = {
            "ttft_ms": round(sum(r[0] for r in sel) / len(sel) * 1000, 2),
            "room_ms": mean_ms(sel, 0),
            "call_ms": mean_ms(sel, 1),
            "rest_ms": mean_ms(sel, 2),
        }
    return out, offset + len(data)


def worker_figures(before: dict, after: dict) -> dict:
    """One worker over a point: mean step, steps, idle and host time between steps (s), and the mean of each
    histogram ``_sum``/``_count`` pair that moved (ms; e.g. the prefill phases, TTFT, TPOT as the worker saw them)."""

    def d(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    steps, step_s = d("distserve_engine_steps"), d("distserve_engine_step_seconds")
    idle = d("distserve_engine_idle_seconds")
    out: dict = {"steps": int(steps), "step_s": round(step_s, 3), "idle_s": round(idle, 3)}
    if steps > 0:
        out["mean_step_ms"] = round(step_s / steps * 1000, 3)
    means = {}
    for key in after:
        if "_count" not in key:
            continue
        n = d(key)
        s_key = key.replace("_count", "_sum", 1)
        if n > 0 and s_key in after:
            means[key.replace("_count", "", 1).removeprefix("distserve_")] = round(d(s_key) / n * 1000, 3)
    out["mean_ms"] = means
    return out


def pyspy_bin() -> str | None:
    found = shutil.which("py-spy")
    if found:
        return found
    cand = Path(sys.executable).with_name("py-spy")
    return str(cand) if cand.exists() else None


def point(srv: ServeProcess, args, rate: float, profile: bool, tmp: Path, journal: Journal) -> dict:
    spec = RunSpec(
        url=srv.url,
        strategy="poisson",
        request_rate=rate,
        num_prompts=args.num_prompts,
        warmup=4,
        seed=int(rate * 100),
        timeout_s=120.0,
        sampling=args.sampling,
    )
    opts = Options(
        spec,
        workload(args.workload, int(rate)),
        slo=SLO,
        percentiles=(50.0, 90.0, 99.0),
        progress=False,
        token=srv.token,
    )
    spies: list[tuple[int, str, subprocess.Popen, Path]] = []
    workers = srv.workers()
    m0 = {w["worker_id"]: scrape(w["url"], srv.token) for w in workers}
    before, c0, t0 = cpu_tree(srv.pid), self_cpu_s(), time.monotonic()
    spy = pyspy_bin() if profile else None
    if spy:
        secs = max(int(args.num_prompts / rate * 0.8), 2)
        for pid, (_, role) in before.items():
            if role in ("router", "prefill", "decode", "colocated"):
                raw = tmp / f"pyspy-{role}-{pid}.txt"
                cmd = [spy, "record", "-p", str(pid), "-d", str(secs), "-r", "200", "-f", "raw", "-o", str(raw)]
                proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                spies.append((pid, role, proc, raw))
    res = run_distbench(opts)
    wall, c1, after = time.monotonic() - t0, self_cpu_s(), cpu_tree(srv.pid)
    worker_rows = []
    for w in workers:
        row = {"role": w["role"], **worker_figures(m0[w["worker_id"]], scrape(w["url"], srv.token))}
        worker_rows.append(row)
    n = max(res.get("completed") or 0, 1)
    out: dict = {"rate": rate, **{k: res.get(k) for k in KEEP}, "wall_s": round(wall, 2), "processes": []}
    client = c1 - c0
    out["processes"].append(
        {"role": "client", "cpu_ms_per_request": round(client / n * 1000, 2), "core_share": round(client / wall, 3)}
    )
    for pid, (cpu, role) in sorted(after.items(), key=lambda kv: kv[1][1]):
        d = cpu - before.get(pid, (0.0, ""))[0]
        out["processes"].append(
            {"role": role, "pid": pid, "cpu_ms_per_request": round(d / n * 1000, 2), "core_share": round(d / wall, 3)}
        )
    out["workers"] = worker_rows
    out["ttft_parts"], journal.offset = journal_parts(journal.path, journal.offset)
    if profile and not spy:
        out["pyspy"] = "py-spy not found (pip install py-spy)"
    if spies:
        out["pyspy"] = {}
        for pid, role, proc, raw in spies:
            try:
                _, err = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                err = b"timed out"
            key = f"{role}:{pid}"
            if raw.exists():
                out["pyspy"][key] = aggregate_pyspy(raw.read_text())
            else:
                out["pyspy"][key] = {"error": err.decode(errors="replace")[-400:]}
    return out


def print_point(layout: str, p: dict) -> None:
    procs = ", ".join(
        f"{q['role']} {q['cpu_ms_per_request']} ms ({q['core_share'] * 100:.0f} %)" for q in p["processes"]
    )
    tp = p.get("ttft_parts") or {}
    print(
        f"{layout} @ {p['rate']:g}/s: {p['completed']} done {p['failed']} failed, attainment {p['slo_attainment']}, "
        f"TTFT p50/p99 {p['p50_ttft_ms']}/{p['p99_ttft_ms']} ms, TPOT p99 {p['p99_tpot_ms']} | {procs}",
        flush=True,
    )
    for w in p.get("workers", []):
        print(
            f"  worker {w['role']}: steps {w['steps']}, mean step {w.get('mean_step_ms')} ms, idle {w['idle_s']} s, "
            f"means ms {w['mean_ms']}"
        )
    if "all" in tp:
        print(f"  TTFT parts ms (room, call, rest): all {tp['all']}, slowest tenth {tp['slowest_tenth']}")
    for key, prof in (p.get("pyspy") or {}).items() if isinstance(p.get("pyspy"), dict) else ():
        if "error" in prof:
            print(f"  py-spy {key}: {prof['error']}")
            continue
        print(f"  py-spy {key}: busy {prof['busy_share']} of {prof['samples']} samples; inclusive:")
        for f, s in prof["inclusive_of_busy"][:18]:
            print(f"    {s * 100:5.1f} % {f[:140]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="preset:llama-2-7b", help="'' = the built-in tiny model")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layouts", default="colocated@512,1p1d")
    ap.add_argument("--rates", default="20,60", help="requests per second, comma-separated")
    ap.add_argument("--num-prompts", type=int, default=300)
    ap.add_argument("--workload", default="128/64", help="PROMPT/OUTPUT or sharegpt")
    ap.add_argument("--sampling", default="greedy", choices=("greedy", "openai-default"))
    ap.add_argument("--prewarm", type=int, default=60)
    ap.add_argument("--pyspy", action="store_true", help="profile the server processes during the last rate")
    ap.add_argument("--budget-s", type=float, default=520.0)
    ap.add_argument("--out", default=str(Path(os.environ.get("OUT", ".")) / "cpu_per_request.json"))
    args = ap.parse_args()
    try:
        rates = [float(r) for r in args.rates.split(",") if r]
        layouts = [(name, *layout_args(name)) for name in args.layouts.split(",") if name]
    except ValueError as e:
        print(f"cpu_per_request: {e}", file=sys.stderr)
        return 2
    doc: dict = {"args": vars(args), "layouts": []}
    t0 = time.monotonic()
    for name, serve, overrides in layouts:
        need = sum(args.num_prompts / r for r in rates) + 60
        if time.monotonic() - t0 + need > args.budget_s:
            doc["layouts"].append({"layout": name, "skipped": f"needs ~{need:.0f} s"})
            continue
        tmp = Path(tempfile.mkdtemp(prefix="cpu-per-request-"))
        cfg = {**({"model": args.model} if args.model else {}), **overrides}
        journal = Journal(tmp / "journal.jsonl")
        cfg["router"] = {**cfg.get("router", {}), "journal_path": str(journal.path)}
        entry: dict = {"layout": name, "points": []}
        doc["layouts"].append(entry)
        with ServeProcess(tmp, config=cfg, extra_args=["--device", args.device, *serve], timeout_s=300) as srv:
            if args.prewarm:
                spec = RunSpec(url=srv.url, strategy="poisson", request_rate=rates[0], num_prompts=args.prewarm, seed=7)
                run_distbench(Options(spec, workload(args.workload, 7), progress=False, token=srv.token))
            for i, rate in enumerate(rates):
                if i == 0 and journal.path.exists():
                    journal.offset = journal.path.stat().st_size  # past the pre-warm's lines
                p = point(srv, args, rate, args.pyspy and i == len(rates) - 1, tmp, journal)
                entry["points"].append(p)
                print_point(name, p)
                write_result(args.out, doc)
        write_result(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
