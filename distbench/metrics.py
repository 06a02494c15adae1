"""One statistics module: HDR histograms of per-request records, SLO attainment, goodput.

Every latency is recorded into an ``HdrHistogram`` in integer microseconds with 3 significant figures
(values from 1 µs to 1 h; a value is off by at most 0.1 %). Every aggregate in a result — mean, std,
median, pNN — is read from these histograms, and the histograms are stored (base64) in the result, so
``distbench merge`` combines runs losslessly and recomputes exactly what a single run would have said.

Percentile rule (nearest rank, as Java's HdrHistogram): pNN is the sample of rank ceil(NN/100 × n) in
sorted order — the smallest value with at least NN % of the samples <= it — reported as the highest
value equivalent to it at 3 significant figures. No interpolation: a P99 is a latency some request had.

Failed-request rule: a failed request (HTTP error, error event in the stream, connection error,
timeout, no token) has no latency, so it is not in the latency histograms (as in ``vllm bench serve``);
it is counted in ``failed``, listed by reason in ``failures``, and counts as a miss in
``slo_attainment`` and in ``request_goodput``. It is never silently dropped.

Cancelled-request rule: a request still in flight when the run stopped (Ctrl-C, the end of
``--duration``'s drain) is neither: it is counted in ``cancelled``. It counts as a miss in
``slo_attainment`` when it had already broken a limit (no first token after the TTFT limit, or longer
than the E2EL limit, or a gap over the ITL limit); otherwise its outcome is unknown and it is left out of
the attainment's denominator (``slo_judged``). A result with cancelled requests never passes (PARTIAL).

Rate-limited rule: a request refused with HTTP 429 (the server's admission at capacity, normally with a
``Retry-After``) is not a failure either: the server answered at once and said when to come back. It is
counted in ``rate_limited`` (``rate_limited_with_retry_after`` of them carried the header), not in
``failed`` nor ``failures``; it was not served, so it counts as a miss in ``slo_attainment`` and
``request_goodput`` as a failure does.
"""

from __future__ import annotations

import math
import re
from collections import Counter

import numpy as np
from hdrh.histogram import HdrHistogram

from distserve.distbench.records import RequestRecord
from distserve.sla import slo as slo_rules

LOWEST_US, HIGHEST_US, SIGNIFICANT = 1, 3_600_000_000, 3
# result-key name -> record attribute; vLLM's names (e2el = end-to-end latency)
METRICS = {"ttft": "ttft", "tpot": "tpot", "itl": "itl", "e2el": "e2e"}
SERVICE = {"ttft_service": "ttft_service", "e2el_service": "e2e_service"}
SLO_NAMES = ("ttft", "tpot", "itl", "e2el")
LATE_S = 0.001  # a send more than 1 ms behind its schedule is "late"
DEFAULT_PERCENTILES = (50.0, 90.0, 95.0, 99.0, 99.9)
MIN_TAIL_SAMPLES = 10  # a pNN needs this many samples above it to be an estimate rather than the maximum


def tail_samples(n: int, q: float) -> float:
    """Samples above the pNN of n samples: n × (1 − q/100); P99.9 of 200 samples has 0.2 (it is the maximum)."""
    return round(n * (1.0 - q / 100.0), 9)


def thin_tail(n: int, q: float) -> bool:
    """Too few samples in the tail for the pNN to be an estimate: P99 below 1 000 samples, P99.9 below 10 000."""
    return tail_samples(n, q) < MIN_TAIL_SAMPLES


def samples_needed(q: float) -> int:
    return int(round(MIN_TAIL_SAMPLES / (1.0 - q / 100.0)))


class Histogram(HdrHistogram):
    """HdrHistogram with the textbook nearest rank, ceil(q/100 * n) (the Python package rounds half up,
    which can report the sample just below the true P99; Java's HdrHistogram takes the ceiling too)."""

    def get_target_count_at_percentile(self, percentile: float) -> int:
        return max(1, math.ceil(round(min(percentile, 100.0) * self.total_count / 100, 9)))

    def moments(self) -> tuple[float, float]:
        """(mean, population std) over the buckets' median-equivalent values, as HdrHistogram defines
        them, with numpy over the non-empty buckets (the package's own loops take ~0.3 s per call)."""
        counts = np.ctypeslib.as_array(self.counts)[: self.counts_len].astype(np.float64)
        idx = np.nonzero(counts)[0]
        if not len(idx):
            return 0.0, 0.0
        vals = np.array([self._hdr_median_equiv_value(self.get_value_from_index(int(i))) for i in idx], float)
        w = counts[idx]
        mean = float(np.dot(vals, w) / w.sum())
        return mean, float(np.sqrt(np.dot((vals - mean) ** 2, w) / w.sum()))


def new_hist() -> Histogram:
    return Histogram(LOWEST_US, HIGHEST_US, SIGNIFICANT)


def record_s(h: HdrHistogram, seconds: float) -> None:
    h.record_value(min(HIGHEST_US, max(0, round(seconds * 1e6))))


def encode(h: HdrHistogram) -> str:
    return h.encode().decode("ascii")


def decode(text: str) -> HdrHistogram:
    out = new_hist()
    out.add(HdrHistogram.decode(text.encode("ascii")))
    return out


def pkey(q: float) -> str:
    """vLLM's spelling: 99 -> 'p99', 99.9 -> 'p99.9'."""
    return f"p{int(q)}" if q == int(q) else f"p{q:g}"


def hist_stats(h: HdrHistogram, name: str, percentiles) -> dict:
    """mean/median/std/pNN of one histogram in milliseconds under vLLM's keys (NaN when empty)."""
    n = h.get_total_count()

    def ms(us: float) -> float:
        return us / 1000.0 if n else math.nan

    mean, std = h.moments()
    out = {
        f"mean_{name}_ms": ms(mean),
        f"median_{name}_ms": ms(h.get_value_at_percentile(50)),
        f"std_{name}_ms": ms(std),
        f"max_{name}_ms": ms(h.get_max_value()),
    }
    for q in percentiles:
        out[f"{pkey(q)}_{name}_ms"] = ms(h.get_value_at_percentile(q))
    return out


def histograms(records: list[RequestRecord]) -> dict[str, HdrHistogram]:
    hs = {name: new_hist() for name in (*METRICS, *SERVICE, "send_lag")}
    for r in records:
        if r.warmup:
            continue
        record_s(hs["send_lag"], r.late)
        if not r.ok:
            continue
        for name, attr in {**METRICS, **SERVICE}.items():
            if attr == "itl":
                for x in r.itl:
                    record_s(hs[name], x)
                continue
            v = getattr(r, attr)
            if v is not None:
                record_s(hs[name], v)
    return hs


def parse_slo(text: str | None) -> dict[str, float]:
    """'ttft:250ms,tpot:50ms' -> {'ttft': 0.25, 'tpot': 0.05} (seconds). 'e2e' is accepted for 'e2el'."""
    out: dict[str, float] = {}
    if not text:
        return out
    for part in text.replace(" ", ",").split(","):
        if not part:
            continue
        name, _, limit = part.strip().partition(":")
        name = "e2el" if name == "e2e" else name
        if name not in SLO_NAMES or not limit:
            raise ValueError(f"--slo: {part!r} is not METRIC:VALUE with METRIC one of {', '.join(SLO_NAMES)}")
        scale = 1e-3 if limit.endswith("ms") else 1.0
        try:
            value = float(limit.removesuffix("ms").removesuffix("s")) * scale
        except ValueError:
            raise ValueError(f"--slo: {limit!r} is not a duration like 250ms or 0.25s") from None
        if not value > 0:
            raise ValueError(f"--slo: {part!r}: the limit must be > 0")
        out[name] = value
    return out


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """vLLM's --goodput: 'ttft:250 tpot:50' in milliseconds -> seconds."""
    out: dict[str, float] = {}
    for item in items or []:
        name, _, value = item.partition(":")
        name = "e2el" if name == "e2e" else name
        if name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput: {item!r}: the key must be one of ttft, tpot, e2el")
        try:
            out[name] = float(value) / 1000.0
        except ValueError:
            raise ValueError(f"--goodput: {item!r} is not KEY:MILLISECONDS like ttft:250") from None
        if out[name] <= 0:
            raise ValueError(f"--goodput: {item!r}: the value must be > 0")
    return out


def meets(r: RequestRecord, slo: dict[str, float]) -> bool:
    """``sla.slo.meets`` (the one definition): a failed request never meets an SLO; ITL: every gap within."""
    return slo_rules.meets({name: getattr(r, attr) for name, attr in METRICS.items()}, slo, ok=r.ok)


def missed_before_cancel(r: RequestRecord, slo: dict[str, float]) -> bool:
    """A cancelled request that had already broken one of the limits when it was cancelled."""
    waited = r.cancelled_after or 0.0

    def over(value: float, name: str) -> bool:
        return not slo_rules.within(value, slo[name])

    if "ttft" in slo and over(r.ttft if r.ttft is not None else waited, "ttft"):
        return True
    if "e2el" in slo and over(waited, "e2el"):
        return True
    return "itl" in slo and bool(r.itl) and over(max(r.itl), "itl")


def failure_reasons(records: list[RequestRecord]) -> dict[str, int]:
    """Failures by reason: the status and message with every number masked (``N``), so 21 prompts that are
    each too long by a different count are one reason, not 21."""
    return dict(
        Counter(
            _NUMBER.sub("N", r.error or "no tokens received")
            for r in records
            if not r.warmup and not r.ok and not r.cancelled and not r.rate_limited
        ).most_common()
    )


# numbers in a failure message, but not the HTTP status that leads it ("HTTP 400: ... 3468 tokens ...")
_NUMBER = re.compile(r"(?<!HTTP )(?<![\w.])\d+(?:\.\d+)?")


def summarize(
    records: list[RequestRecord],
    duration_s: float,
    percentiles=DEFAULT_PERCENTILES,
    slo: dict[str, float] | None = None,
    goodput: dict[str, float] | None = None,
) -> dict:
    """The result's figures under vLLM's key names, plus what coordinated omission hides."""
    slo, goodput = slo or {}, goodput or {}
    measured = [r for r in records if not r.warmup]
    ok = [r for r in measured if r.ok]
    hs = histograms(records)
    dur = duration_s if duration_s > 0 else math.nan
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    cancelled = [r for r in measured if r.cancelled]
    limited = [r for r in measured if r.rate_limited]
    s: dict = {
        "num_prompts": len(measured),
        "completed": len(ok),
        "failed": len(measured) - len(ok) - len(cancelled) - len(limited),
        "cancelled": len(cancelled),
        "rate_limited": len(limited),
        "rate_limited_with_retry_after": sum(1 for r in limited if r.retry_after is not None),
        "duration": duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / dur,
        "output_throughput": out_tokens / dur,
        "total_token_throughput": (in_tokens + out_tokens) / dur,
        "failures": failure_reasons(records),
    }
    for name in (*METRICS, *SERVICE):
        s.update(hist_stats(hs[name], name, percentiles))
    lag = hs["send_lag"]
    s["late_sends"] = sum(1 for r in measured if r.late > LATE_S)
    s["late_threshold_ms"] = LATE_S * 1000
    s.update(hist_stats(lag, "send_lag", percentiles))
    delayed = [r.backoff for r in measured if r.backoff > 0]
    s["backoff_delays"], s["backoff_total_s"] = len(delayed), float(sum(delayed))
    s["sample_counts"] = {name: hs[name].get_total_count() for name in (*METRICS, *SERVICE)}
    if slo:
        s["slo"] = {k: v * 1000 for k, v in slo.items()}
        s["slo_met"] = sum(meets(r, slo) for r in measured)
        unknown = sum(1 for r in cancelled if not missed_before_cancel(r, slo))
        s["slo_judged"] = len(measured) - unknown
        s["slo_attainment"] = s["slo_met"] / s["slo_judged"] if s["slo_judged"] else 0.0
    gp = goodput or slo
    s["request_goodput"] = (
        sum(meets(r, {k: v for k, v in gp.items() if k != "itl"}) for r in measured) / dur if gp else None
    )
    s["histograms"] = {name: encode(h) for name, h in hs.items()}
    return s


def merge_histograms(encoded: list[dict[str, str]]) -> dict[str, HdrHistogram]:
    out: dict[str, HdrHistogram] = {}
    for hs in encoded:
        for name, text in hs.items():
            out.setdefault(name, new_hist()).add(decode(text))
    return out


def stats_of(values_s: list[float], name: str = "x", percentiles=DEFAULT_PERCENTILES) -> dict:
    """The same figures for any list of durations in seconds (bench scripts that time something else)."""
    h = new_hist()
    for v in values_s:
        record_s(h, v)
    return hist_stats(h, name, percentiles)


def attainment(records: list[RequestRecord], slo: dict[str, float]) -> float:
    """Fraction of the measured requests meeting ``slo``; failed requests count as misses."""
    measured = [r for r in records if not r.warmup]
    return sum(meets(r, slo) for r in measured) / len(measured) if measured else 0.0


def percentile_with_failures(records: list[RequestRecord], metric: str, q: float) -> float:
    """pNN of ``metric`` in ms over *all* measured requests, a failed one counting as infinitely slow:
    ``inf`` when more than (100 - q) % failed. The percentile form of the failed-request rule."""
    measured = [r for r in records if not r.warmup]
    ok = [v for r in measured if r.ok and (v := getattr(r, METRICS.get(metric, metric))) is not None]
    if not measured:
        return math.nan
    rank = max(1, math.ceil(round(q / 100 * len(measured), 9)))
    if rank > len(ok):
        return math.inf
    h = new_hist()
    for v in ok:
        record_s(h, v)
    return h.get_value_at_percentile(100.0 * rank / len(ok)) / 1000.0
