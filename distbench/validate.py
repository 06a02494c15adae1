"""Is this a distbench result that ``compare`` and ``merge`` may read? Schema and value ranges.

A corrupt or hand-edited result used to pass through ``merge`` into a new file, or crash ``compare``
with a traceback. ``check_result(path, doc)`` raises ``ValueError`` (one sentence naming the file and
the field; the CLI turns it into exit status 2) unless:

- the top level has ``start_unix <= end_unix`` (both present) (finite, non-negative), non-negative integer counts
  (``num_prompts``, ``completed``, ``failed``, token totals) with ``completed + failed <= num_prompts``
  when ``num_prompts`` is given, ``percentiles`` a list of numbers in (0, 100];
- ``histograms`` maps names to HDR histograms that decode;
- ``requests`` is a list of objects whose latencies (``scheduled``, ``sent``, ``start_unix``, ``ttft``,
  ``ttft_service``, ``e2e``, each ``itl`` gap) are finite and non-negative or null, token counts
  non-negative integers, ``error`` a string or null, ``e2e >= ttft`` when both are there.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

COUNTS = (
    "num_prompts",
    "completed",
    "failed",
    "rate_limited",
    "total_input_tokens",
    "total_output_tokens",
    "late_sends",
)
LATENCIES = ("scheduled", "sent", "start_unix", "ttft", "ttft_service", "e2e")
TOKENS = ("prompt_tokens", "output_tokens")


def _finite_nonneg(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def check_result(path: str | Path, doc: Any) -> dict:
    """``doc`` if it is a valid distbench result, else ValueError naming ``path`` and the field."""

    def bad(where: str, what: str) -> ValueError:
        return ValueError(f"{path}: {where}: {what}; not a valid distbench result")

    if not isinstance(doc, dict):
        raise bad("top level", "not a JSON object")
    for k in ("start_unix", "end_unix", "percentiles"):
        if k not in doc:
            raise bad(k, "missing")
    for k in ("start_unix", "end_unix"):
        if k in doc and not _finite_nonneg(doc[k]):
            raise bad(k, f"must be a finite non-negative number, got {doc[k]!r}")
    if "start_unix" in doc and "end_unix" in doc and doc["end_unix"] < doc["start_unix"]:
        raise bad("end_unix", "is before start_unix")
    for k in COUNTS:
        if k in doc and not _count(doc[k]):
            raise bad(k, f"must be a non-negative integer, got {doc[k]!r}")
    if _count(doc.get("num_prompts")) and doc.get("completed", 0) + doc.get("failed", 0) > doc["num_prompts"]:
        raise bad("completed", "completed + failed is more than num_prompts")
    pcts = doc.get("percentiles", [])
    if not isinstance(pcts, list) or not all(_finite_nonneg(q) and 0 < q <= 100 for q in pcts):
        raise bad("percentiles", f"must be a list of numbers in (0, 100], got {pcts!r}")
    hists = doc.get("histograms")
    if not isinstance(hists, dict):
        raise bad("histograms", "must be an object of encoded HDR histograms")
    from distserve.distbench.metrics import decode

    for name, text in hists.items():
        try:
            decode(text)
        except Exception as e:  # noqa: BLE001 - hdrhistogram raises several kinds on a corrupt blob
            raise bad(f"histograms.{name}", f"does not decode ({type(e).__name__})") from None
    reqs = doc.get("requests")
    if not isinstance(reqs, list):
        raise bad("requests", "must be a list of per-request records")
    for i, r in enumerate(reqs):
        if not isinstance(r, dict):
            raise bad(f"requests[{i}]", "not an object")
        for k in LATENCIES:
            if r.get(k) is not None and not _finite_nonneg(r[k]):
                raise bad(f"requests[{i}].{k}", f"must be a finite non-negative number or null, got {r[k]!r}")
        itl = r.get("itl", [])
        if not isinstance(itl, list) or not all(_finite_nonneg(x) for x in itl):
            raise bad(f"requests[{i}].itl", "must be a list of finite non-negative numbers")
        for k in TOKENS:
            if k in r and not _count(r[k]):
                raise bad(f"requests[{i}].{k}", f"must be a non-negative integer, got {r[k]!r}")
        if r.get("error") is not None and not isinstance(r["error"], str):
            raise bad(f"requests[{i}].error", "must be a string or null")
        if r.get("ttft") is not None and r.get("e2e") is not None and r["e2e"] < r["ttft"]:
            raise bad(f"requests[{i}].e2e", "is less than its ttft")
    return doc


def load_checked(paths: list[str]) -> list[dict]:
    """Load and check every result (``compare``/``merge`` call this on their inputs first); a bad one is
    a ``UsageError`` (exit status 2, one sentence)."""
    from distserve.distbench import result
    from distserve.distbench.runner import UsageError

    out = []
    for p in paths:
        try:
            out.append(check_result(p, result.load(p)))
        except (ValueError, OSError) as e:
            raise UsageError(str(e)) from None
    return out
