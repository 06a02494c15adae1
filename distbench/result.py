"""The result file: vLLM ``bench serve`` keys, HDR histograms, per-request records, config, environment.

Written atomically (temporary file + ``os.replace``), so a crash or Ctrl-C never leaves half a report.
``load`` checks the file is a distbench result; ``recompute`` rebuilds every figure from the records.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import sys
import time
from pathlib import Path

from distserve.distbench.atomic import atomic_write
from distserve.distbench.metrics import summarize
from distserve.distbench.records import SCHEMA_VERSION, RequestRecord


def environment() -> dict:
    import aiohttp

    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "host": socket.gethostname(),
        "cpus": os.cpu_count(),
        "aiohttp": aiohttp.__version__,
        "argv": sys.argv,
    }


def build(
    records: list[RequestRecord],
    duration_s: float,
    start_unix: float,
    config: dict,
    percentiles,
    slo: dict,
    goodput: dict,
    server_metrics: dict | None = None,
    interrupted: str | None = None,
) -> dict:
    figures_of = records
    if config.get("compat") == "vllm":  # vLLM's definitions (distbench/vllm_compat.py); raw records kept
        from distserve.distbench.vllm_compat import vllm_view

        figures_of = vllm_view(records)
    s = summarize(figures_of, duration_s, percentiles, slo, goodput)
    measured = [r for r in records if not r.warmup]
    return {
        "distbench_schema": SCHEMA_VERSION,
        "backend": "distbench",
        "date": time.strftime("%Y%m%d-%H%M%S", time.gmtime(start_unix)),
        "start_unix": start_unix,
        "end_unix": start_unix + duration_s,
        "model_id": config.get("model"),
        "endpoint": config.get("endpoint"),
        "request_rate": config.get("request_rate") if config.get("strategy") != "closed" else "inf",
        "burstiness": config.get("burstiness"),
        "max_concurrency": config.get("max_concurrency") or config.get("concurrency"),
        "strategy": config.get("strategy"),
        "percentiles": list(percentiles),
        "interrupted": interrupted,
        "compat": config.get("compat"),
        **s,
        # vLLM's per-request arrays (seconds), in send order, measured requests only
        "ttfts": [r.ttft if r.ok else 0.0 for r in measured],
        "itls": [r.itl if r.ok else [] for r in measured],
        "input_lens": [r.prompt_tokens for r in measured],
        "output_lens": [r.output_tokens if r.ok else 0 for r in measured],
        "errors": [r.error or "" for r in measured],
        "requests": [r.to_dict() for r in records],
        "server_metrics": server_metrics or {},
        "config": config,
        "environment": environment(),
    }


def save(result: dict, path: str | Path) -> Path:
    return atomic_write(path, json.dumps(result, indent=1, default=float))


def load(path: str | Path) -> dict:
    p = Path(path)
    try:
        d = json.loads(p.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    if not isinstance(d, dict) or "histograms" not in d or "requests" not in d:
        raise ValueError(f"{path}: not a distbench result (no histograms/requests)")
    return d


def records_of(result: dict, include_warmup: bool = False) -> list[RequestRecord]:
    recs = [RequestRecord.from_dict(d) for d in result["requests"]]
    return recs if include_warmup else [r for r in recs if not r.warmup]
