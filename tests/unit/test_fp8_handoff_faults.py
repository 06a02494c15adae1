"""An FP8 KV hand-off with a bad handle or a lying sender, through the real worker apps and the real data plane.

A prefill worker app with an FP8 KV cache stages each prompt's KV on a real ``KVStagingServer`` (tcp); its
handle is tampered with as JSON (the scales NaN, inf, 0, negative, a huge integer, the wrong count, present for a
non-FP8 dtype, missing for FP8) and given to a decode worker app (FP8 cache, real ``KVPuller``) on
``/internal/generate``. Each is refused with a sentence on the stream (never a traceback or a cut stream), the
decode worker holds no KV block afterwards, and the untouched handle still pulls and decodes (nothing was
pulled, hence nothing unstaged, for the refused ones).
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading

import httpx
import pytest
import torch

from distserve.server.config import load_config
from distserve.server.engine.llm_engine import EngineConfig, LLMEngine
from distserve.server.engine.sampling_params import SamplingParams
from distserve.server.kv_transfer import KVHandle, KVPuller, KVStagingServer, TransferStatus
from distserve.server.kv_transfer import frame as fr
from distserve.server.metrics import WorkerMetrics
from distserve.server.workers.app import WorkerState, create_worker_app
from distserve.server.workers.engine_loop import EngineLoop

AUTH = {"Authorization": "Bearer t"}
SAMPLING = {"max_tokens": 4, "temperature": 0.0, "top_p": 1.0, "ignore_eos": True}
PROMPT = [3, 9, 8, 7, 6, 5, 4, 11, 12]


def _engine() -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            block_size=4,
            num_blocks=64,
            enable_prefix_caching=False,
            attention_backend="sdpa",
            kv_cache_dtype="fp8_e4m3",
            kv_calibration_requests=0,
        )
    )


def _state(role: str, engine: LLMEngine, **kw) -> WorkerState:
    cfg = load_config(overrides={"kv_transfer": {"failure_policy": "fail"}})
    return WorkerState(
        role=role,
        worker_id=role[0] + "0",
        config=cfg,
        token="t",
        loop=EngineLoop(engine, threaded=True),
        metrics=WorkerMetrics(role),
        **kw,
    )


def _last_line(text: str) -> dict:
    lines = [json.loads(x) for x in text.splitlines() if x.strip()]
    assert lines, "empty stream"
    return lines[-1]


def _fp8_handle(address: str, shape: list[int], nbytes: int, layers: int) -> dict:
    """An FP8 KV handle (as the router passes it on) naming ``address`` as its sender."""
    return {
        "request_id": "r",
        "transport": "tcp",
        "address": address,
        "secret": "ab" * 16,
        "nbytes": nbytes,
        "shape": list(shape),
        "dtype": "float8_e4m3fn",
        "checksum": None,
        "host_id": "h",
        "kv_scales": [[0.01, 0.01]] * layers,
    }


def _tampered(kv: dict) -> list[tuple[str, str]]:
    """(name, the handle as JSON text) for each bad variant; JSON text so NaN/Infinity/huge ints survive."""
    pairs = kv["kv_scales"]
    out = []
    for name, value in (
        ("nan", "NaN"),
        ("inf", "Infinity"),
        ("-inf", "-Infinity"),
        ("zero", "0"),
        ("negative", "-0.5"),
        ("huge-int", "1" + "0" * 400),
        ("inf-as-float32", "1e300"),  # finite in JSON, inf in the float32 the scales are used in
        ("zero-as-float32", "1e-50"),  # > 0 in JSON, 0 in float32
        ("float32-subnormal", "1e-40"),
        ("bool", "true"),
        ("string", '"0.1"'),
    ):
        first = [["@"] + pairs[0][1:]] + pairs[1:]
        text = json.dumps({**kv, "kv_scales": first}).replace('"@"', value)
        out.append((name, text))
    out.append(("one-pair-short", json.dumps({**kv, "kv_scales": pairs[:-1]})))
    out.append(("one-pair-more", json.dumps({**kv, "kv_scales": pairs + [[1.0, 1.0]]})))
    out.append(("triple", json.dumps({**kv, "kv_scales": [p + [1.0] for p in pairs]})))
    out.append(("missing", json.dumps({k: v for k, v in kv.items() if k != "kv_scales"})))
    n = kv["nbytes"]
    out.append(("non-fp8-dtype", json.dumps({**kv, "dtype": "uint8", "nbytes": n})))
    return out


def test_tampered_fp8_scales_are_refused_by_the_decode_worker_and_leak_nothing():
    async def main():
        pre_engine, dec_engine = _engine(), _engine()
        with KVStagingServer(io_timeout_s=10.0) as sender, KVPuller() as puller:
            pre = _state("prefill", pre_engine, sender=sender)
            dec = _state("decode", dec_engine, puller=puller)
            pre.loop.start()
            dec.loop.start()
            try:
                p_app, d_app = create_worker_app(pre), create_worker_app(dec)
                async with (
                    httpx.AsyncClient(transport=httpx.ASGITransport(app=p_app), base_url="http://p") as ph,
                    httpx.AsyncClient(transport=httpx.ASGITransport(app=d_app), base_url="http://d") as dh,
                ):
                    body = {"request_id": "r", "prompt_token_ids": PROMPT, "sampling": SAMPLING}
                    r = await ph.post("/internal/prefill", json=body, headers=AUTH)
                    assert r.status_code == 200, r.text
                    answer = r.json()
                    kv = answer["kv"]
                    assert (
                        kv["dtype"] == "float8_e4m3fn"
                        and len(kv["kv_scales"]) == pre_engine.model_config.num_hidden_layers
                    )
                    gen = {**body, "output_token_ids": answer["token_ids"]}
                    refused = {}
                    for name, handle_text in _tampered(kv):
                        raw = json.dumps({**gen, "kv": "@"}).replace('"@"', handle_text)
                        headers = {**AUTH, "Content-Type": "application/json"}
                        g = await dh.post("/internal/generate", content=raw.encode(), headers=headers)
                        refused[name] = (g.status_code, _last_line(g.text) if g.status_code == 200 else g.text)
                        assert dec_engine.num_used_blocks == 0, name
                    assert sender.num_staged == 1  # nothing was pulled
                    g = await dh.post("/internal/generate", json={**gen, "kv": kv}, headers=AUTH)
                    good = _last_line(g.text)
            finally:
                pre.loop.stop()
                dec.loop.stop()
            return refused, good, sender.num_staged, dec_engine

    refused, good, staged, dec_engine = asyncio.run(main())
    for name, (status, last) in refused.items():
        assert status == 200, (name, status, last)
        assert last["finished"] and "invalid kv handle" in (last.get("error") or ""), (name, last)
    assert good.get("error") is None and good["finished"], good
    assert staged == 0  # the good pull unstaged it
    assert dec_engine.num_used_blocks == 0 and dec_engine.requests == {}
    dec_engine.block_manager.check_invariants()


@pytest.mark.parametrize("value", [10**400, -(10**400), 1e300, 1e-50, 1e-40])
def test_huge_integer_scales_are_a_value_error_not_an_overflow(value):
    from distserve.server.engine.fp8 import check_scales
    from distserve.server.kv_transfer.base import check_kv_scales

    with pytest.raises(ValueError, match="finite"):
        check_kv_scales(((value, 1.0),), "float8_e4m3fn", (1, 2, 3, 1, 4))
    with pytest.raises(ValueError, match="finite"):
        check_scales([[value, 1.0]], 1)


# ------------------------------------------------------------------ non-finite KV values and the calibration
def _hand_off_all(pre: LLMEngine, dec: LLMEngine, prompts: dict[str, list[int]], corrupt: str | None) -> dict:
    """Prefill each prompt on ``pre``, stage its KV over tcp (``corrupt``'s with a NaN and an inf written into
    it by the prefill side, so its checksum still holds), pull it and commit it on ``dec``; run ``dec`` to the
    end. Returns (error or None, tokens) by request."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for r, p in prompts.items():
        pre.add_request(r, p, params, prefill_only=True)
    first: dict[str, list[int]] = {}
    while pre.has_unfinished_requests():
        for o in pre.step():
            first[o.request_id] = o.new_token_ids
    with KVStagingServer(io_timeout_s=10.0) as srv, KVPuller() as puller:
        for r, p in prompts.items():
            _, kv = pre.take_prefilled_kv(r)
            if r == corrupt:
                kv = kv.clone()
                kv[0, 0, 3, 0, 0] = float("nan")
                kv[1, 1, 2, 0, 1] = float("inf")
            h = KVHandle.from_dict(json.loads(json.dumps(srv.stage(r, kv, transport="tcp").to_dict())))
            got = puller.pull(h, 10)
            assert got.status is TransferStatus.SUCCESS, got.error
            assert dec.reserve_prefilled(r, p, first[r], params)
            dec.commit_prefilled(r, got.tensor)
    out: dict[str, tuple[str | None, list[int]]] = {r: (None, list(first[r])) for r in prompts}
    while dec.has_unfinished_requests():
        for o in dec.step():
            out[o.request_id] = (o.error, out[o.request_id][1] + o.new_token_ids)
    return out


def _decode_engine(kv_cache_dtype: str, calibration: int = 0) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            dtype="float32",
            block_size=4,
            num_blocks=64,
            enable_prefix_caching=False,
            attention_backend="sdpa",
            kv_cache_dtype=kv_cache_dtype,
            kv_calibration_requests=calibration,
        )
    )


def _prefill_engine() -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            dtype="float32", block_size=4, num_blocks=64, enable_prefix_caching=False, attention_backend="sdpa"
        )
    )


# "c" is the shortest: its padded tail in the batched decode reads the other sequences' blocks
NAN_PROMPTS = {"bad": PROMPT, "b": [5, 17, 29, 41, 53, 65, 77, 89], "c": [7, 100, 90, 80, 70, 60, 50]}


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_a_hand_off_with_non_finite_kv_values_fails_only_its_own_request(kv_cache_dtype):
    """The sdpa backend decodes a batch over padded block tables; the padding reads other sequences' blocks,
    masked. A NaN in one request's KV (a faulty prefill device: the wire checks sizes, crc and scales, not
    values) failed another request of the batch too (NaN + -inf is NaN; 0 * NaN is NaN). Now only its own."""
    dec = _decode_engine(kv_cache_dtype)
    last = _hand_off_all(_prefill_engine(), dec, NAN_PROMPTS, corrupt="bad")
    assert last["bad"][0] is not None and "NaN" in last["bad"][0]
    assert last["b"][0] is None and last["c"][0] is None, (last["b"], last["c"])
    want = _decode_engine(kv_cache_dtype)
    clean = _hand_off_all(_prefill_engine(), want, {k: v for k, v in NAN_PROMPTS.items() if k != "bad"}, None)
    for r in ("b", "c"):
        assert last[r] == clean[r]
    assert dec.num_used_blocks == 0
    dec.block_manager.check_invariants()


def test_a_hand_off_with_non_finite_kv_values_fails_alone_and_does_not_poison_the_fp8_scales():
    """A prefill worker's KV with a NaN and an inf in it (a faulty device, a bug: the wire checks the scales,
    not every value) goes into a calibrating FP8 decode worker. Only that request may suffer; the calibrated
    scales stay finite and the next request decodes as on a decode worker that never saw the bad KV (before: the
    running amax became NaN/inf, every scale NaN or inf after calibration, every later request garbage)."""

    poisoned, clean = _decode_engine("fp8_e4m3", 2), _decode_engine("fp8_e4m3", 2)
    _hand_off_all(_prefill_engine(), poisoned, NAN_PROMPTS, corrupt="bad")
    _hand_off_all(_prefill_engine(), clean, NAN_PROMPTS, corrupt=None)
    got, want = poisoned.kv_calibration_report(), clean.kv_calibration_report()
    assert got["state"] == want["state"] == "calibrated"
    for g, w in zip(got["scales"], want["scales"]):
        for a, b in zip(g, w):
            assert math.isfinite(a) and a > 0
            assert abs(a - b) <= 0.25 * b, (got["scales"], want["scales"])
    after = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    probe = [[3, 30, 31, 32, 33, 34, 35, 36, 37, 38]]
    assert poisoned.generate(probe, after) == clean.generate(probe, after)
    assert poisoned.num_used_blocks == 0
    poisoned.block_manager.check_invariants()


def test_a_non_finite_amax_keeps_the_layers_current_scale_at_calibration():
    """Writers that cannot filter (a GPU kernel's atomic max of a NaN) may leave a NaN or inf amax: that layer
    keeps its current scale at calibration, the others calibrate; the cache stays finite."""
    from distserve.server.engine.fp8 import FP8_MAX, HEADROOM, KVCalibration

    cal = KVCalibration.create(3, torch.device("cpu"), 0.5, 1)
    cal.amax.copy_(torch.tensor([[float("nan"), 2.0], [float("inf"), 4.0], [8.0, 16.0]]))
    cache = [torch.full((2, 4, 1, 2), 3.0).to(torch.float8_e4m3fn) for _ in range(3)]
    assert cal.on_finished(1, cache)
    got = cal.scales.tolist()
    assert got[0][0] == 0.5 and got[1][0] == 0.5
    assert got[0][1] == pytest.approx(2.0 * HEADROOM / FP8_MAX) and got[2][1] == pytest.approx(
        16.0 * HEADROOM / FP8_MAX
    )
    assert all(bool(torch.isfinite(c.float()).all()) for c in cache)


# ------------------------------------------------------------------ a sender whose sizes lie
class _LyingSender:
    """Answers one PULL with ``behave(conn)``: a broken or hostile prefill worker against the real decode worker."""

    def __init__(self, behave) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.release = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(behave,), daemon=True)
        self.thread.start()

    def _run(self, behave) -> None:
        conn, _ = self.sock.accept()
        with conn:
            fr.read_frame(conn)
            behave(conn, self.release)

    def close(self) -> None:
        self.release.set()
        self.thread.join(timeout=5)
        self.sock.close()


def _header(shape, dtype=torch.float8_e4m3fn, nbytes=None) -> bytes:
    n = math.prod(shape) * dtype.itemsize if nbytes is None else nbytes
    return fr.encode_frame(fr.Frame(fr.FrameType.DATA_INLINE, request_id="r", dtype=dtype, shape=shape, nbytes=n))


def test_a_sender_whose_sizes_lie_fails_the_pull_and_leaks_no_block():
    """More bytes announced than the handle promised, a size that contradicts its own shape, another dtype, fewer
    bytes then a close, fewer bytes then silence: each fails the pull with its reason (failure_policy fail), no KV
    block stays reserved, nothing waits past the pull timeout. More bytes *after* the full payload: the payload is
    verified and used, the connection is not reused."""
    engine = _engine()
    shape = engine.runner.kv_shape(len(PROMPT))
    full = math.prod(shape)
    bigger = (shape[0], shape[1], shape[2] * 64, *shape[3:])
    cases = {
        "more than the handle": (lambda c, _: c.sendall(_header(bigger)), "does not match the handle"),
        "size against its own shape": (lambda c, _: c.sendall(_header(shape, nbytes=1 << 60)), "payload nbytes"),
        "another dtype": (lambda c, _: c.sendall(_header(shape, torch.uint8)), "does not match the handle"),
        "fewer, then closed": (lambda c, _: c.sendall(_header(shape) + b"\0" * (full // 2)), f"of {full} payload"),
        "fewer, then silent": (
            lambda c, rel: (c.sendall(_header(shape) + b"\0" * (full // 2)), rel.wait(10)),
            "timed out",
        ),
        "more after the payload": (lambda c, _: c.sendall(_header(shape) + b"\x38" * full + b"garbage" * 9), None),
    }
    layers = engine.model_config.num_hidden_layers

    async def main():
        cfg = load_config(overrides={"kv_transfer": {"failure_policy": "fail", "pull_timeout_ms": 1000}})
        with KVPuller() as puller:
            state = WorkerState(
                role="decode",
                worker_id="d0",
                config=cfg,
                token="t",
                loop=EngineLoop(engine, threaded=True),
                metrics=WorkerMetrics("decode"),
                puller=puller,
            )
            state.loop.start()
            out = {}
            try:
                app = create_worker_app(state)
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://d") as http:
                    for name, (behave, _) in cases.items():
                        fake = _LyingSender(behave)
                        handle = _fp8_handle(fake.address, shape, full, layers)
                        body = {
                            "request_id": "r",
                            "prompt_token_ids": PROMPT,
                            "output_token_ids": [5],
                            "sampling": SAMPLING,
                            "kv": handle,
                        }
                        g = await http.post("/internal/generate", json=body, headers=AUTH, timeout=30)
                        fake.close()
                        await asyncio.sleep(0.05)
                        out[name] = (g.status_code, _last_line(g.text), engine.num_used_blocks, len(engine.requests))
            finally:
                state.loop.stop()
        return out

    out = asyncio.run(main())
    for name, (_, words) in cases.items():
        status, last, used, live = out[name]
        assert status == 200 and last["finished"] and (used, live) == (0, 0), (name, out[name])
        if words is None:
            assert last.get("error") is None, (name, last)
        else:
            assert words in (last.get("error") or ""), (name, last)
    engine.block_manager.check_invariants()


def test_a_handle_larger_than_the_requests_kv_is_refused_before_any_byte_is_pulled():
    """A handle whose shape is not this request's KV (here 2**22 tokens, 4 GiB of e4m3: under the 64 GiB cap every
    handle gets) made the decode worker allocate that much and pull it before the commit compared shapes. It is
    refused on arrival now: the sender is never contacted, nothing is reserved."""
    engine = _engine()
    layers = engine.model_config.num_hidden_layers
    shape = list(engine.runner.kv_shape(1 << 22))
    contacted, stop = threading.Event(), threading.Event()
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(0.1)

    def watch() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            contacted.set()
            conn.close()  # a sender that would then stream 4 GiB

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()

    async def main():
        with KVPuller() as puller:
            state = _state("decode", engine, puller=puller)
            state.loop.start()
            try:
                app = create_worker_app(state)
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://d") as http:
                    handle = _fp8_handle(f"127.0.0.1:{srv.getsockname()[1]}", shape, math.prod(shape), layers)
                    body = {
                        "request_id": "r",
                        "prompt_token_ids": PROMPT,
                        "output_token_ids": [5],
                        "sampling": SAMPLING,
                    }
                    g = await http.post("/internal/generate", json={**body, "kv": handle}, headers=AUTH, timeout=30)
                    return _last_line(g.text)
            finally:
                state.loop.stop()

    try:
        last = asyncio.run(main())
    finally:
        stop.set()
        watcher.join(timeout=5)
        srv.close()
    assert last["finished"] and "invalid kv handle" in (last.get("error") or "") and "shape" in last["error"], last
    assert not contacted.is_set(), "the decode worker pulled a KV of another shape"
    assert engine.num_used_blocks == 0 and engine.requests == {}
