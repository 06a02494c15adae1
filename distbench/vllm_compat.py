"""vLLM's definitions: read ``vllm bench serve`` result files as distbench records, and ``--compat vllm``.

vLLM saves per-request arrays in seconds: ``ttfts`` (from the actual send), ``latencies``, ``output_lens``,
``errors``; TPOT is (latency - ttft) / (output_len - 1) in both tools. With these records the one statistics
module (``distbench.metrics``) answers for vLLM's runs too.

``--compat vllm`` (``vllm_view``): the figures of a run computed the way ``vllm bench serve`` computes them.
Where the two tools' definitions differ (docs/DISTBENCH.md, "Agreement with vllm bench serve"):

- TTFT and E2EL from the *actual* send, not the scheduled one (vLLM does not know the schedule): each
  record's ``ttft``/``e2e`` become its service times and its send is taken as on time;
- vLLM's arrival schedule (``vllm_offsets``): the first request waits one gap, and the n gaps are scaled
  so the n-th request is due at exactly n / rate. distbench's own Poisson process lets the n-th arrival
  fall where it falls (±1/√n of n / rate: ±11 % at 80 requests), which moves a short run's throughput
  by as much; vLLM's schedule fixes the offered rate, and so its throughput, to the nominal one.

What both tools already share: TPOT = (last token − first token) / (output tokens − 1) with the output
tokens from the final ``usage``; ITL = gaps between token-carrying chunks; a completions chunk with a
choice is a token (first token = the first such chunk); failed requests out of the latency figures.
Percentiles stay nearest rank from HDR histograms (vLLM interpolates between ranks); means do not
depend on that rule.
"""

from __future__ import annotations

from dataclasses import replace

from distserve.distbench.records import RequestRecord

COMPAT = ("vllm",)


def vllm_offsets(offsets_from_zero: list[float], rate: float) -> list[float]:
    """vLLM 0.32's ``get_request`` schedule built from n + 1 of our arrival offsets (the first at 0):
    the first request one gap in, the n-th at exactly n / rate."""
    n = len(offsets_from_zero) - 1
    raw = offsets_from_zero[1:]
    if n < 1 or raw[-1] <= 0:
        return raw
    scale = (n / rate) / raw[-1]
    return [o * scale for o in raw]


def vllm_view(records: list[RequestRecord]) -> list[RequestRecord]:
    """Copies of the records with vLLM's TTFT/E2E (from the actual send); the originals are untouched."""
    out = []
    for r in records:
        lag = r.sent - r.scheduled
        out.append(
            replace(
                r,
                itl=list(r.itl),
                scheduled=r.sent,
                start_unix=r.start_unix + lag,
                ttft=r.ttft_service,
                e2e=None if r.e2e is None else r.e2e - lag,
            )
        )
    return out


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
