"""The FP8 KV calibration at other moments: requests aborted or failed in its window do not count towards it, and
a calibration that lands while a sequence is mid-decode (the cache re-quantised in place under it) leaves that
sequence's tokens as if the scales had been set before it started, and its logits within the KV-only tolerance
(5 %, tests/unit/test_fp8.py) of float32."""

from __future__ import annotations

import torch

from distserve.server.engine.llm_engine import EngineConfig, LLMEngine
from distserve.server.engine.sampling_params import SamplingParams
from distserve.server.workers.fault import arm_oom

LONG = [3 + (j * 13) % 250 for j in range(40)]
SHORT = [5 + (j * 7) % 250 for j in range(15)]


def _engine(**kw) -> LLMEngine:
    base = dict(
        dtype="float32",
        block_size=4,
        num_blocks=128,
        enable_prefix_caching=False,
        attention_backend="sdpa",
        kv_calibration_requests=0,
    )
    base.update(kw)
    return LLMEngine(EngineConfig(**base))


def _params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _long_run(eng: LLMEngine, with_short: bool) -> tuple[list[int], torch.Tensor, list[str]]:
    """LONG (12 tokens) beside SHORT (3 tokens, finishing at step 3: the calibration when its target is 1)."""
    logits: list[torch.Tensor] = []
    orig = eng.runner.execute

    def execute(scheduled):
        out = orig(scheduled)
        for s, row in zip([s for s in scheduled if s.samples], out):
            if s.seq.request_id == "long":
                logits.append(row.float().clone())
        return out

    eng.runner.execute = execute
    eng.add_request("long", LONG, _params(12))
    if with_short:
        eng.add_request("short", SHORT, _params(3))
    tokens: list[int] = []
    states = []
    while eng.has_unfinished_requests():
        for o in eng.step():
            assert o.error is None, o.error
            if o.request_id == "long":
                tokens += o.new_token_ids
        rep = eng.kv_calibration_report()
        states.append(rep["state"] if rep else "none")
    eng.runner.execute = orig
    return tokens, torch.stack(logits), states


def test_a_calibration_landing_mid_decode_leaves_the_running_sequence_intact():
    inflight = _engine(kv_cache_dtype="fp8_e4m3", kv_calibration_requests=1)
    got, got_logits, states = _long_run(inflight, with_short=True)
    assert "calibrating" in states and states[-1] == "calibrated"
    assert states.index("calibrated") < len(got) - 1  # it landed while "long" was still decoding
    before = _engine(kv_cache_dtype="fp8_e4m3")  # the same scales, set before "long" starts
    cal = before.runner.kv_calibration
    cal.apply(inflight.runner.kv_calibration.scales.clone(), before.runner.kv_caches)
    want, want_logits, _ = _long_run(before, with_short=True)
    assert got == want
    ref_tokens, ref_logits, _ = _long_run(_engine(), with_short=True)
    err = ((got_logits - ref_logits).norm(dim=-1) / ref_logits.norm(dim=-1)).max().item()
    assert err < 0.05, err
    assert inflight.num_used_blocks == 0


def test_aborted_and_failed_requests_do_not_count_towards_calibration():
    eng = _engine(kv_cache_dtype="fp8_e4m3", kv_calibration_requests=2)
    eng.add_request("aborted", [3, 4, 5, 6, 7, 8, 9], _params(10))
    eng.add_request("failed", [4, 5, 6, 7, 8], _params(10))
    eng.step()
    eng.abort_request("aborted")
    arm_oom(eng, 1)  # the next forward raises: "failed", alone in it, fails
    errors = [o.error for _ in range(3) for o in eng.step() if o.request_id == "failed" and o.finished]
    assert errors and errors[0] and "out of memory" in errors[0].lower()
    assert not eng.has_unfinished_requests()
    rep = eng.kv_calibration_report()
    assert (rep["state"], rep["requests_seen"]) == ("calibrating", 0)
    assert eng.generate([[7, 8, 9, 10]], _params(2)) and eng.kv_calibration_report()["requests_seen"] == 1
    assert eng.generate([[11, 12, 13]], _params(2)) and eng.kv_calibration_report()["state"] == "calibrated"
    assert eng.num_used_blocks == 0
