"""Read ``vllm bench serve`` result files (``--save-detailed``) as distbench records.

vLLM saves per-request arrays in seconds: ``ttfts`` (from the actual send), ``latencies``, ``output_lens``,
``errors``; TPOT is (latency - ttft) / (output_len - 1) in both tools. With these records the one statistics
module (``distbench.metrics``) answers for vLLM's runs too.
"""

from __future__ import annotations

from distbench.records import RequestRecord


def records_from_vllm(d: dict) -> list[RequestRecord] | None:
    ttfts, lats, outs = d.get("ttfts"), d.get("latencies"), d.get("output_lens")
    if not (isinstance(ttfts, list) and isinstance(lats, list) and isinstance(outs, list)):
        return None
    if not len(ttfts) == len(lats) == len(outs):
        return None
    errors = d.get("errors") or [""] * len(ttfts)
    ins = d.get("input_lens") or [0] * len(ttfts)
    recs = []
    for i, (ttft, lat, out, err, inp) in enumerate(zip(ttfts, lats, outs, errors, ins)):
        ok = bool(out) and out > 0 and ttft is not None and ttft > 0 and not err
        recs.append(
            RequestRecord(
                i,
                0.0,
                0.0,
                ttft=ttft if ok else None,
                ttft_service=ttft if ok else None,
                e2e=lat if ok else None,
                prompt_tokens=inp or 0,
                output_tokens=out or 0,
                error=None if ok else (err or "no tokens"),
            )
        )
    return recs
