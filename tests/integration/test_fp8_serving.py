"""FP8 KV through the real server on the CPU: a compute-dtype prefill worker hands its KV over tcp to a decode worker
whose cache is FP8 (emulated) and calibrates online. The calibration window's requests are served; the decode
worker's /metrics then report it calibrated with finite scales (the prefill worker reports none); and every
request after it decodes exactly the tokens of an in-process prefill -> FP8 decode pair holding those scales (the
hand-off quantised once, on the decode side, with the decode worker's scales)."""

from __future__ import annotations

import math
import re

import pytest
import torch

from distserve.server.engine.llm_engine import EngineConfig, LLMEngine
from distserve.server.engine.sampling_params import SamplingParams

from .conftest import http
from .test_serving import MAX_TOKENS, PROMPTS, assert_no_leaks, run_concurrently

CALIBRATION = 4
_SCALE = re.compile(r'^distserve_kv_cache_scale\{kind="([kv])",layer="(\d+)"\} (\S+)$')


@pytest.fixture(scope="module")
def fp8(serve_factory):
    return serve_factory(
        config={
            "cache": {"kv_dtype": "fp8_e4m3", "kv_calibration_requests": CALIBRATION},
            "kv_transfer": {"transport": "tcp"},
        }
    )


def _scales(metrics: str) -> list[list[float]]:
    found: dict[int, list[float]] = {}
    for line in metrics.splitlines():
        m = _SCALE.match(line)
        if m:
            found.setdefault(int(m.group(2)), [0.0, 0.0])["kv".index(m.group(1))] = float(m.group(3))
    return [found[i] for i in range(len(found))]


def _in_process(prompts, scales) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    small = dict(num_blocks=128, enable_prefix_caching=False, attention_backend="sdpa")  # prefill: the same SDPA path
    pre = LLMEngine(EngineConfig(**small))
    dec = LLMEngine(EngineConfig(kv_cache_dtype="fp8_e4m3", kv_calibration_requests=0, **small))
    cal = dec.runner.kv_calibration
    cal.apply(torch.tensor(scales, dtype=torch.float32), dec.runner.kv_caches)
    out = []
    for i, p in enumerate(prompts):
        rid = f"p{i}"
        pre.add_request(rid, p, params, prefill_only=True)
        first: list[int] = []
        while pre.has_unfinished_requests():
            for o in pre.step():
                first = o.new_token_ids
        _, kv = pre.take_prefilled_kv(rid)
        assert dec.reserve_prefilled(rid, p, first, params)
        dec.commit_prefilled(rid, kv)
        tokens = list(first)
        while dec.has_unfinished_requests():
            for o in dec.step():
                assert o.error is None, o.error
                tokens.extend(o.new_token_ids)
        out.append(tokens)
    return out


def test_bf16_prefill_to_a_calibrating_fp8_decode_worker(fp8):
    run_concurrently(fp8.url, True, prompts=PROMPTS[:CALIBRATION])
    workers = {w["role"]: w for w in fp8.workers()}
    _, dec_metrics, _ = http("GET", f"{workers['decode']['url']}/metrics")
    _, pre_metrics, _ = http("GET", f"{workers['prefill']['url']}/metrics")
    assert "distserve_kv_cache_calibrated 1.0" in dec_metrics, dec_metrics[-3000:]
    assert "distserve_kv_cache_scale" not in pre_metrics  # its cache is in the compute dtype
    scales = _scales(dec_metrics)
    assert scales and all(math.isfinite(s) and s > 0 and s != 1.0 for pair in scales for s in pair), scales
    later = PROMPTS[CALIBRATION : CALIBRATION + 4]
    assert run_concurrently(fp8.url, True, prompts=later) == _in_process(later, scales)
    assert run_concurrently(fp8.url, False, prompts=later[:2]) == _in_process(later[:2], scales)
    assert_no_leaks(fp8)
