"""Derive the tracked headline summaries (``bench/baselines/<hardware>/<study>.json``) and the kept raw records
(``bench/records/<hardware>/<study>/<name>``) from a results folder.

    python -m bench.lib.baselines --results bench/results     # (re)writes bench/baselines/ and bench/records/

Run once over the recorded ``bench/results/`` of the history (git ``2026-12-02``, before the folder left the
tree) and again after a study writes new results there. Each summary names every source file with its sha256,
so a figure quoted in the docs can be traced to the raw file in git history (``git log --all -- PATH``). A summary
is the result with its per-request arrays left out and long numeric lists reduced to n/min/median/max; kept
records (``KEEP``: what the shipped H200 profile is built from and what the published replays read) are the raw
file with floats rounded to 1 us / 6 decimals and xz-compressed (``bench/README.md`` states their size budget).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import lzma
import re
import statistics
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
BASELINES = REPO / "bench" / "baselines"
RECORDS = REPO / "bench" / "records"

# (pattern over the path relative to the results folder, study id, hardware); first match wins; no match: dropped
RULES: tuple[tuple[str, str, str], ...] = (
    (r"^ab_serving_cpu_", "serving-ab", "cpu"),
    (r"^cache_routing_cpu", "serving-cache-routing", "cpu"),
    (r"^distbench_vs_vllm_", "loadgen-vs-vllm-client", "cpu"),
    (r"^engine_cpu", "engine-cpu", "cpu"),
    (r"^failure_semantics", "resilience-failure-semantics", "cpu"),
    (r"^fp8_accuracy", "engine-fp8-accuracy", "cpu"),
    (r"^gemv_study.*\.json$", "kernels-gemv", "h200"),
    (r"^gpu_engine_.*_x2\.json$", "engine-gpu", "h200-x2"),
    (r"^gpu_engine_.*\.json$", "engine-gpu", "h200"),
    (r"^gpu_fp8", "kernels-fp8", "h200"),
    (r"^gpu_issue16/slo_study_.*\.json\.gz$", "serving-slo-study", "h200-x2"),
    (r"^gpu_issue16/kv_sizing\.json$", "engine-kv-sizing", "h200-x2"),
    (r"^gpu_issue16/prefill_.*\.(json|txt)$", "serving-prefill-profile", "h200-x2"),
    (r"^gpu_issue16/sdpa_shapes\.json$", "kernels-sdpa-shapes", "h200"),
    (r"^gpu_issue16_b/kv_transfer_gpu\.json$", "kv-transfer-gpu", "h200"),
    (r"^gpu_issue16_lengths/", "engine-prefill-lengths", "h200"),
    (r"^gpu_issue16_rerun/.*\.json\.gz$", "serving-slo-study", "h200-x2"),
    (r"^gpu_issue16_thread/mdl_.*\.json\.gz$", "serving-slo-study", "h200-x2"),
    (r"^gpu_issue16_thread/prefill_.*\.json$", "serving-prefill-profile", "h200-x2"),
    (r"^gpu_issue17_prefill/engine_alone/", "engine-prefill-mix", "h200"),
    (r"^gpu_issue17_prefill/prefix_hits/", "engine-prefill-mix", "h200"),
    (r"^gpu_issue17_prefill/.*\.json\.gz$", "serving-slo-study", "h200"),
    (r"^gpu_issue19/.*\.json\.gz$", "serving-slo-study", "h200-x4"),
    (r"^gpu_issue36/one_gpu_defaults\.json$", "serving-one-gpu-defaults", "h200"),
    (r"^gpu_issue36/nan_check\.json$", "serving-one-gpu-defaults", "h200"),
    (r"^gpu_issue36/sm_split\.json$", "serving-sm-split", "h200"),
    (r"^gpu_serving_one-gpu.*\.json$", "serving-gpu", "h200"),
    (r"^gpu_serving_two-gpu.*\.json$", "serving-gpu", "h200-x2"),
    (r"^kv_transfer_gpu_x2_.*\.json$", "kv-transfer-gpu", "h200-x2"),
    (r"^kv_transfer_gpu_.*\.json$", "kv-transfer-gpu", "h200"),
    (r"^overload_cpu", "resilience-overload", "cpu"),
    (r"^plan_accuracy_", "planner-accuracy", "h200"),
    (r"^plan_cpu_(check|profile)_", "planner-cpu-check", "cpu"),
    (r"^ray_join_", "resilience-ray-join", "cpu"),
    (r"^sampler_cpu_before_after", "engine-sampler-before-after", "cpu"),
    (r"^sampler_cpu_", "engine-sampler", "cpu"),
    (r"^sampler_gpu_", "engine-sampler", "h200"),
    (r"^serving_cpu_", "serving-cpu", "cpu"),
    (r"^sla_failover_vllm", "peers-sla-failover-vllm", "cpu"),
    (r"^vs_vllm_cpu.*(\.tar\.xz|_summary\.md)$", "peers-vs-vllm", "cpu"),
)

# raw records kept in git: old path -> new name under bench/records/<hardware>/<study>/ (the H200 profile's
# inputs, bench/planner/h200_profile.py, and the recorded runs the published replays read)
KEEP: dict[str, str] = {
    "gpu_engine_2026-11-29_run2.json": "engine-gpu/2026-11-29-run2.json.xz",
    "gpu_issue16/kv_sizing.json": "engine-kv-sizing/2026-11-30.json.xz",
    "gpu_issue16/prefill_after_out16.json": "serving-prefill-profile/after_out16_2026-11-30.json.xz",
    "kv_transfer_gpu_x2_2026-11-29_run2.json": "kv-transfer-gpu/x2_2026-11-29-run2.json.xz",
    "gpu_issue16/slo_study_1p1d.json.gz": "serving-slo-study/1p1d_2026-11-30.json.xz",
    "gpu_issue16/slo_study_1p1d_flash.json.gz": "serving-slo-study/1p1d_flash_2026-11-30.json.xz",
    "gpu_issue16/slo_study_colocated2_flash.json.gz": "serving-slo-study/colocated2_flash_2026-11-30.json.xz",
    "gpu_issue16_rerun/slo_study_1p1d.json.gz": "serving-slo-study/1p1d_rerun_2026-12-01.json.xz",
    "gpu_issue19/slo_study_x4_2p2d.json.gz": "serving-slo-study/x4_2p2d_2026-11-30.json.xz",
    "gpu_issue19/slo_study_x4_3p1d.json.gz": "serving-slo-study/x4_3p1d_2026-11-30.json.xz",
    "gpu_issue19/slo_study_x4_1p3d.json.gz": "serving-slo-study/x4_1p3d_2026-11-30.json.xz",
    "gpu_issue19/slo_study_x4_colocated4.json.gz": "serving-slo-study/x4_colocated4_2026-11-30.json.xz",
    "gpu_issue16_lengths/prefill_lengths_x2_before_varlen.txt": "engine-prefill-lengths/before_varlen_2026-11-30.txt",
    "gpu_issue17_prefill/engine_alone/prefill_probe_engine.json": "engine-prefill-mix/probe_engine_2026-12-01.json.xz",
    "gpu_issue17_prefill/run2/prefill_serving_thread_on_r1.json.gz": "serving-slo-study/prefill_r1_2026-12-01.json.xz",
    "gpu_issue17_prefill/run2/prefill_serving_thread_on_r2.json.gz": "serving-slo-study/prefill_r2_2026-12-01.json.xz",
    "plan_cpu_profile_2026-11-30.json": "planner-cpu-check/profile_2026-11-30.json.xz",
    # the published CPU comparison with vLLM (its result files, logs left out)
    "vs_vllm_cpu_run6.tar.xz": "peers-vs-vllm/run6_2026-11-30.json.xz",
}
HARDWARE_OF_KEPT = {"engine-gpu/2026-11-29-run2.json.xz": "h200"}

SUMMARY_BYTES = 24_000  # a summary over this keeps only its scalars
LIST_KEEP = 16  # longer numeric lists become n/min/median/max
DROP_KEYS = {"requests", "itl", "itls", "serve_log_tail", "log_tail", "stderr_tail", "stdout_tail", "samples"}


def read_any(path: Path) -> Any:
    raw = path.read_bytes()
    if path.name.endswith(".gz"):
        raw = gzip.decompress(raw)
    elif path.name.endswith(".xz"):
        raw = lzma.decompress(raw)
    if path.suffix in (".txt", ".md", ".log"):
        return raw.decode()
    return json.loads(raw)


def rounded(o: Any) -> Any:
    if isinstance(o, float):
        return round(o, 6)
    if isinstance(o, dict):
        return {k: rounded(v) for k, v in o.items()}
    if isinstance(o, list):
        return [rounded(v) for v in o]
    return o


def summarize(o: Any, depth: int = 0) -> Any:
    """The headline figures of a result: per-request arrays out, long numeric lists as n/min/median/max."""
    if isinstance(o, dict):
        return {k: summarize(v, depth + 1) for k, v in o.items() if k not in DROP_KEYS}
    if isinstance(o, list):
        nums = [x for x in o if isinstance(x, int | float) and not isinstance(x, bool)]
        if len(o) > LIST_KEEP and len(nums) == len(o):
            return {"n": len(nums), "min": min(nums), "median": statistics.median(nums), "max": max(nums)}
        if len(o) > LIST_KEEP:
            return [summarize(x, depth + 1) for x in o[:LIST_KEEP]] + [f"... {len(o) - LIST_KEEP} more"]
        return [summarize(x, depth + 1) for x in o]
    if isinstance(o, float):
        return round(o, 6)
    if isinstance(o, str) and len(o) > 400:
        return o[:400] + " ..."
    return o


def scalars_only(o: Any) -> Any:
    if isinstance(o, dict):
        out = {k: scalars_only(v) for k, v in o.items() if not isinstance(v, list)}
        return {k: v for k, v in out.items() if v != {}}
    return o


def tar_summary(path: Path) -> dict[str, Any]:
    with tarfile.open(path) as t:
        names = [m.name for m in t.getmembers() if m.isfile()]
    return {"archive_members": len(names), "results": sorted(n for n in names if n.endswith(".json"))}


def added_on(path: Path) -> str:
    out = subprocess.run(
        ["git", "-C", str(REPO), "log", "--diff-filter=A", "--format=%cs %h", "-1", "--", str(path)],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return out or "untracked"


def study_of(rel: str) -> tuple[str, str] | None:
    for pat, study, hw in RULES:
        if re.search(pat, rel):
            return study, hw
    return None


def derive(results: Path) -> dict[str, int]:
    by: dict[tuple[str, str], dict[str, Any]] = {}
    for f in sorted(p for p in results.rglob("*") if p.is_file()):
        rel = f.relative_to(results).as_posix()
        hit = study_of(rel)
        if hit is None:
            continue
        study, hw = hit
        sha = hashlib.sha256(f.read_bytes()).hexdigest()
        if rel.endswith(".tar.xz"):
            summary: Any = tar_summary(f)
        else:
            doc = read_any(f)
            summary = doc if isinstance(doc, str) else summarize(doc)
            if not isinstance(summary, str) and len(json.dumps(summary)) > SUMMARY_BYTES:
                summary = scalars_only(summary)
        entry = by.setdefault((hw, study), {"study": study, "hardware": hw, "runs": {}})
        run = {"source": f"bench/results/{rel}", "sha256": sha, "added": added_on(f), "summary": summary}
        if rel in KEEP:
            run["record"] = f"bench/records/{HARDWARE_OF_KEPT.get(KEEP[rel], hw)}/{KEEP[rel]}"
        entry["runs"][rel] = run
    sizes = {}
    for (hw, study), entry in sorted(by.items()):
        entry["derived_by"] = "python -m bench.lib.baselines (summaries of the recorded results; bench/README.md)"
        out = BASELINES / hw / f"{study}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(entry, indent=1, sort_keys=False) + "\n")
        sizes[str(out.relative_to(REPO))] = out.stat().st_size
    for rel, name in KEEP.items():
        src = results / rel
        if not src.exists():
            print(f"kept record missing: {src}", file=sys.stderr)
            continue
        hit = study_of(rel)
        hw = HARDWARE_OF_KEPT.get(name, hit[1] if hit else "unknown")
        out = RECORDS / hw / name
        out.parent.mkdir(parents=True, exist_ok=True)
        if rel.endswith(".tar.xz"):
            with tarfile.open(src) as t:
                members = [m for m in t.getmembers() if m.isfile() and m.name.endswith(".json")]
                docs = {m.name.rsplit("/", 1)[-1]: json.load(t.extractfile(m)) for m in members}  # type: ignore[arg-type]
            out.write_bytes(lzma.compress(json.dumps(rounded(docs), separators=(",", ":")).encode(), preset=9))
        elif name.endswith(".xz"):
            doc = rounded(read_any(src))
            out.write_bytes(lzma.compress(json.dumps(doc, separators=(",", ":")).encode(), preset=9))
        else:
            out.write_bytes(src.read_bytes())
        sizes[str(out.relative_to(REPO))] = out.stat().st_size
    return sizes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.lib.baselines", description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default=str(REPO / "bench" / "results"), help="the results folder to derive from")
    a = ap.parse_args(argv)
    results = Path(a.results)
    if not results.is_dir():
        print(f"no results folder at {results}", file=sys.stderr)
        return 2
    sizes = derive(results)
    base = sum(v for k, v in sizes.items() if k.startswith("bench/baselines"))
    rec = sum(v for k, v in sizes.items() if k.startswith("bench/records"))
    print(f"{len(sizes)} files: baselines {base / 1e6:.2f} MB, records {rec / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
