"""One ``distbench run``: check the target, build the workload, send it, scrape, assemble the result.

Shared by ``run``, ``sweep`` and the demo. Errors the user can fix (bad options, unreachable URL, no
vocabulary for random prompts) raise ``UsageError``: the CLI prints its one sentence and exits 2.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import signal
import sys
from dataclasses import asdict, dataclass, field, replace

import aiohttp

from distserve.distbench import promscrape, result
from distserve.distbench.datasets import FitToServer, Item, Lengths, Vocab, jsonl_items, random_items, sharegpt_items
from distserve.distbench.loadgen import RunSpec, run_load
from distserve.distbench.metrics import DEFAULT_PERCENTILES, parse_goodput, parse_slo
from distserve.distbench.progress import Monitor, watch
from distserve.sla.slo import attainment_meets


class UsageError(ValueError):
    """A problem with what the user asked for: one sentence, exit status 2."""


@dataclass(frozen=True)
class Workload:
    dataset: str = "random"  # random | sharegpt | sharegpt:PATH | jsonl:PATH
    prompt_len: str = "128"
    output_len: str | None = None  # None: 64 for random prompts; ShareGPT/jsonl: the dataset's own lengths
    prefix_len: int = 0
    turns: int = 1
    tokenizer: str | None = None
    seed: int = 0


@dataclass(frozen=True)
class Options:
    spec: RunSpec
    workload: Workload = field(default_factory=Workload)
    slo: str | None = None
    goodput: tuple[str, ...] = ()
    slo_target: float = 0.9
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    stop_on_saturation: bool = False
    progress: bool = True
    token: str | None = None  # admin token: worker /metrics and the vocabulary from /v1/workers
    compat: str | None = None  # "vllm": the figures under vllm bench serve's definitions (vllm_compat.py)


async def probe(base: str, token: str | None) -> dict:
    """GET /v1/models (and /v1/workers with a token). Unreachable -> UsageError."""
    info: dict = {}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            async with http.get(f"{base}/v1/models") as r:
                if r.status == 200:
                    data = (await r.json()).get("data") or [{}]
                    info["model"] = data[0].get("id")
                    info["max_model_len"] = data[0].get("max_model_len")
            if token:
                async with http.get(f"{base}/v1/workers", headers={"Authorization": f"Bearer {token}"}) as r:
                    if r.status == 200:
                        ws = (await r.json()).get("workers") or []
                        vs = [w.get("fingerprint", {}).get("vocab_size") for w in ws]
                        info["vocab_size"] = next((v for v in vs if v), None)
            if not info.get("vocab_size"):  # distserve names its vocabulary in the 400 for an id outside it
                body = {"prompt_token_ids": [2**31 - 1], "max_tokens": 1}
                async with http.post(f"{base}/generate", json=body) as r:
                    m = re.search(r"in \[0, (\d+)\)", await r.text()) if r.status == 400 else None
                    info["vocab_size"] = int(m.group(1)) if m else None
    except (aiohttp.ClientError, TimeoutError, OSError) as e:
        raise UsageError(f"cannot reach {base}: {type(e).__name__}: {e}") from None
    return info


CHAT_TEMPLATE_RESERVE = 64  # tokens kept free for a chat template's role markers and default system prompt


def build_items(w: Workload, n: int, info: dict, chat: bool = False) -> tuple[list[Item], Vocab | None]:
    try:
        prompt = Lengths.parse(w.prompt_len, "--prompt-len")
        given = Lengths.parse(w.output_len, "--output-len") if w.output_len is not None else None
        output = given or Lengths.parse("64", "--output-len")
        vocab = (
            Vocab.from_tokenizer(w.tokenizer)
            if w.tokenizer
            else (Vocab(int(info["vocab_size"])) if info.get("vocab_size") else None)
        )
        pool = min(n, 2000)  # cycled: long closed-loop runs need no huge list
        kind, _, path = w.dataset.partition(":")
        if kind == "random":
            if vocab is None:
                raise UsageError(
                    "--dataset random needs the target's vocabulary: the server did not say it; "
                    "give --tokenizer MODEL_DIR (or --token for distserve's /v1/workers)"
                )
            return random_items(pool, prompt, output, vocab, w.seed, w.prefix_len, w.turns), vocab
        if kind == "sharegpt":
            limit = int(info.get("max_model_len") or 2048)
            fit = FitToServer(limit, reserve=CHAT_TEMPLATE_RESERVE if chat else 0)
            info["dataset_fit"] = fit
            return sharegpt_items(pool, path or None, vocab, given, w.seed, limit, fit=fit), vocab
        if kind == "jsonl" and path:
            return jsonl_items(path, None, vocab, given, w.seed), vocab
        raise UsageError(f"--dataset {w.dataset!r}: use random, sharegpt, sharegpt:PATH or jsonl:PATH")
    except UsageError:
        raise
    except ValueError as e:
        raise UsageError(str(e)) from None


def validate(opts: Options) -> tuple[dict, dict]:
    try:
        slo, gp = parse_slo(opts.slo), parse_goodput(list(opts.goodput))
    except ValueError as e:
        raise UsageError(str(e)) from None
    if not 0 < opts.slo_target <= 1:
        raise UsageError(f"--slo-target must be in (0, 1], got {opts.slo_target}")
    if opts.stop_on_saturation and not slo:
        raise UsageError("--stop-on-saturation needs --slo")
    return slo, gp


async def run_async(opts: Options, stop: asyncio.Event | None = None) -> dict:
    slo, gp = validate(opts)
    spec = opts.spec
    info = await probe(spec.url, opts.token)
    if spec.model is None and info.get("model"):
        spec = replace(spec, model=info["model"])
    items, vocab = build_items(opts.workload, spec.num_prompts, info, chat=spec.endpoint == "/v1/chat/completions")
    fit = info.pop("dataset_fit", None)
    if fit is not None and fit.dropped:
        print(fit.line(), file=sys.stderr)
    if spec.strategy == "trace":
        if any(i.at is None for i in items):
            raise UsageError("--strategy trace needs --dataset jsonl:PATH with a timestamp on every line")
        spec = replace(spec, num_prompts=min(spec.num_prompts, len(items)))
    planned = spec.num_prompts
    if spec.duration_s and spec.request_rate and spec.strategy != "trace":
        planned = min(planned, math.ceil(spec.request_rate * spec.duration_s))
    before = await promscrape.scrape(spec.url, opts.token)
    stop = stop or asyncio.Event()
    mon = Monitor(planned, slo, opts.slo_target)
    watcher = asyncio.create_task(watch(mon, stop, opts.stop_on_saturation, opts.progress and sys.stderr.isatty()))
    try:
        records, duration, start = await run_load(spec, items, vocab, mon.on_done, mon.on_sent, stop, _drain_line)
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    after = await promscrape.scrape(spec.url, opts.token)
    interrupted = (
        "saturated: SLO attainment target out of reach"
        if mon.saturated
        else ("stopped by signal" if stop.is_set() else None)
    )
    config = {
        **asdict(spec),
        "workload": asdict(opts.workload),
        "slo": opts.slo,
        "goodput": list(opts.goodput),
        "slo_target": opts.slo_target,
        "compat": opts.compat,
        "vocab_size": vocab.size if vocab else None,
        "server": info,
    }
    res = result.build(
        records, duration, start, config, opts.percentiles, slo, gp, promscrape.deltas(before, after), interrupted
    )
    res["slo_target"] = opts.slo_target
    if fit is not None:
        res["dataset_fit"] = {"max_model_len": fit.max_model_len, "considered": fit.considered, "dropped": fit.dropped}
    res["TTFT_P99"] = res.get("p99_ttft_ms")  # the source article's key: the same figure, milliseconds
    res["sampling"] = spec.sampling  # how the tokens were chosen (--sampling), beside every figure
    res["verdict"] = verdict(res)
    return res


def _drain_line(reason: str, n: int, up_to_s: float) -> None:
    if n:
        print(f"{reason}: draining {n} requests, up to {up_to_s:g} s", file=sys.stderr, flush=True)


def verdict(res: dict) -> dict:
    """pass/fail and one line saying why (failed requests count as misses). A run that was stopped, or
    whose drain ran out with requests in flight (``cancelled``), is PARTIAL: never a pass. Requests the
    server refused with 429 (``rate_limited``: admission at capacity) are not failures; the line counts
    them apart, and a run in which every request was refused does not pass (nothing was served)."""
    n, failed, cancelled = res["num_prompts"], res["failed"], res.get("cancelled", 0)
    limited = res.get("rate_limited", 0)
    if n == 0:
        return {"pass": False, "line": "FAIL: no request was sent"}
    shed = ""
    if limited:
        with_ra = res.get("rate_limited_with_retry_after", 0)
        ra = "all with Retry-After" if with_ra == limited else f"{with_ra} with Retry-After"
        shed = f"; {limited} refused with 429 ({ra}), not counted as failures"
    if "slo_attainment" in res:
        att, target = res["slo_attainment"], res["slo_target"]
        ok = attainment_meets(att, target)
        slo = ", ".join(f"{k} <= {v:g} ms" for k, v in res["slo"].items())
        word, body = (
            "PASS" if ok else "FAIL",
            f"SLO attainment {100 * att:.1f}% {'>=' if ok else '<'} target {100 * target:g}% "
            f"({slo}; {failed} of {n} requests failed{shed})",
        )
    elif failed:
        ok, word, body = False, "FAIL", f"{failed} of {n} requests failed ({res['completed']} completed{shed})"
    elif limited and not res["completed"]:
        ok, word, body = False, "FAIL", f"no request completed: {limited} of {n} refused with 429"
    elif limited:
        ok, word, body = True, "PASS", f"0 failed: {res['completed']} of {n} requests completed{shed}"
    else:
        ok, word, body = True, "PASS", f"all {n - cancelled} requests completed"
    stopped = res.get("interrupted")
    if stopped and stopped.startswith("saturated"):
        return {"pass": False, "line": f"FAIL: {body} (stopped early: {stopped})"}
    if stopped or cancelled:
        why = stopped or "duration reached"
        return {
            "pass": False,
            "partial": True,
            "line": f"PARTIAL ({why}; {cancelled} of {n} requests cancelled in flight): {body}",
        }
    return {"pass": ok, "line": f"{word}: {body}"}


def run(opts: Options) -> dict:
    """Synchronous run with Ctrl-C (SIGINT) and SIGTERM wired to a graceful stop."""

    async def main() -> dict:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop.set)
            except (NotImplementedError, RuntimeError):
                pass
        try:
            return await run_async(opts, stop)
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                try:
                    loop.remove_signal_handler(sig)
                except (NotImplementedError, RuntimeError):
                    pass

    return asyncio.run(main())


def admin_token(explicit: str | None) -> str | None:
    return explicit or os.environ.get("DISTSERVE_ADMIN_TOKEN") or None


def dump_config(res: dict) -> str:
    return json.dumps(res["config"], indent=1)
