"""The ``cpu_paged`` decode kernel against the SDPA backend's gather + SDPA decode.

Random caches, shuffled (non-contiguous) block tables, ragged lengths from 1 to
2048, GQA and MHA, head dims 64/80/128 (and odd ones for the scalar tails):
float32 results within 1e-5 of the output's scale. Bad inputs raise ValueError.
The engine gives the same greedy tokens with ``cpu_paged`` as with ``sdpa``.
The first test that needs the kernel compiles it (a few seconds, once per cache dir).
"""

from __future__ import annotations

import pytest
import torch

from distserve.server.engine.attention import cpu_paged, get_attention_backend
from distserve.server.engine.attention.base import AttentionMetadata
from distserve.server.engine.attention.cpu_paged import CpuPagedBackend, paged_decode_attention
from distserve.server.engine.attention.sdpa import SdpaBackend


@pytest.fixture
def kernel():
    """Builds the kernel on first use (inside the test session's cache dir, not at collection time).
    Skips only where there is no compiler at all; a build that fails with a compiler present fails."""
    if not cpu_paged.available():
        reason = cpu_paged.unavailable_reason() or ""
        if "no C++ compiler" in reason or "DISTSERVE_DISABLE_CPU_PAGED" in reason:
            pytest.skip(reason)
        pytest.fail(reason)


needs_kernel = pytest.mark.usefixtures("kernel")


def _lengths(bs: int) -> list[int]:
    pows = [2**i for i in range(12)]  # 1 .. 2048
    return sorted({1, max(1, bs - 1), bs, bs + 1, 3 * bs - 1, 1000, *pows})


def _case(lengths, h, hkv, d, bs, dtype=torch.float32, seed=0, pad_value=0, spare_blocks=5):
    """A shuffled paged cache holding ``len(lengths)`` sequences; returns q, cache, tables, lens, meta."""
    g = torch.Generator().manual_seed(seed)
    b = len(lengths)
    need = [-(-n // bs) for n in lengths]
    width = max(need) + 2  # padded wider than any sequence needs
    nb = sum(need) + spare_blocks
    kv = torch.randn(2, nb * bs, hkv, d, generator=g).to(dtype)
    perm = torch.randperm(nb, generator=g)
    tables = torch.full((b, width), pad_value, dtype=torch.long)
    used = 0
    for i, k in enumerate(need):
        tables[i, :k] = perm[used : used + k]
        used += k
    lens = torch.tensor(lengths, dtype=torch.long)
    q = torch.randn(b, h, d, generator=g).to(dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long),
        block_size=bs,
        prefill_query_lens=[],
        prefill_seq_lens=[],
        prefill_block_tables=[],
        decode_seq_lens=lens,
        decode_block_tables=tables.clamp(0, nb - 1),
        decode_max_seq_len=max(lengths),
    )
    return q, kv, tables, lens, meta


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))


@needs_kernel
@pytest.mark.parametrize("h,hkv", [(8, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("d", [64, 80, 128])
@pytest.mark.parametrize("bs", [4, 16])
def test_matches_sdpa_decode(h, hkv, d, bs):
    lengths = _lengths(bs)
    q, kv, tables, lens, meta = _case(lengths, h, hkv, d, bs, seed=d * 100 + bs + h)
    scale = d**-0.5
    ref = SdpaBackend._decode(q, kv, meta, scale, h != hkv)
    got = paged_decode_attention(q, kv, tables, lens, scale, bs)
    assert got.shape == ref.shape and got.dtype == torch.float32
    assert _rel_err(got, ref) <= 1e-5
    for i, n in enumerate(lengths):  # per sequence too: a short one must not hide under a long one's scale
        assert _rel_err(got[i], ref[i]) <= 1e-5, f"seq {i} (len {n})"


@needs_kernel
@pytest.mark.parametrize("d", [8, 20, 36, 72])
def test_odd_head_dims_take_the_tails(d):
    q, kv, tables, lens, meta = _case([1, 5, 33, 100], 6, 3, d, 8, seed=d)
    ref = SdpaBackend._decode(q, kv, meta, 0.3, True)
    assert _rel_err(paged_decode_attention(q, kv, tables, lens, 0.3, 8), ref) <= 1e-5


@needs_kernel
def test_padding_entries_past_the_last_block_are_never_read():
    q, kv, tables, lens, meta = _case([3, 17, 40], 4, 2, 64, 16, pad_value=10**9)
    ref = SdpaBackend._decode(q, kv, meta, 0.125, True)
    assert _rel_err(paged_decode_attention(q, kv, tables, lens, 0.125, 16), ref) <= 1e-5


@needs_kernel
@pytest.mark.parametrize("threads", [2, 3])
def test_threads_and_head_splits_agree(threads):
    q, kv, tables, lens, _ = _case([1, 700, 2048], 8, 4, 64, 16, seed=7)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = paged_decode_attention(q, kv, tables, lens, 0.125, 16)
        torch.set_num_threads(threads)
        many = paged_decode_attention(q, kv, tables, lens, 0.125, 16)
        single = paged_decode_attention(q[1:2], kv, tables[1:2], lens[1:2], 0.125, 16)  # B < threads
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)
    assert torch.equal(single[0], one[1])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(dtype):
    q, kv, tables, lens, meta = _case([1, 16, 300, 1024], 8, 2, 64, 16, dtype=dtype, seed=3)
    ref = SdpaBackend._decode(q.float(), kv.float(), meta, 0.125, True)  # fp32 math on the same values
    got = paged_decode_attention(q, kv, tables, lens, 0.125, 16)
    assert got.dtype == dtype
    assert _rel_err(got, ref) <= (1e-2 if dtype == torch.bfloat16 else 2e-3)


@needs_kernel
def test_out_argument_and_non_contiguous_q():
    q, kv, tables, lens, meta = _case([5, 9], 4, 4, 64, 4)
    wide = torch.cat([q, q], dim=2)[:, :, :64]  # a non-contiguous view of q's values
    out = torch.full_like(q, float("nan"))
    res = paged_decode_attention(wide, kv, tables, lens, 0.125, 4, out=out)
    assert res is out
    assert _rel_err(out, SdpaBackend._decode(q, kv, meta, 0.125, False)) <= 1e-5
    empty = paged_decode_attention(q[:0], kv, tables[:0], lens[:0], 0.125, 4)
    assert empty.shape == (0, 4, 64)


def _bad_inputs():
    q, kv, tables, lens, _ = _case([5, 9], 4, 2, 64, 4, spare_blocks=0)
    nb = kv.shape[1] // 4
    ok = dict(q=q, kv_cache=kv, block_tables=tables, seq_lens=lens, scale=0.125, block_size=4)
    bad_table = tables.clone()
    bad_table[1, 1] = nb  # one past the last block
    neg_table = tables.clone()
    neg_table[0, 0] = -1
    return {
        "q 2-D": dict(ok, q=q[0]),
        "q dtype != cache": dict(ok, q=q.double()),
        "float64": dict(ok, q=q.double(), kv_cache=kv.double()),
        "cache 3-D": dict(ok, kv_cache=kv[0]),
        "cache not K/V": dict(ok, kv_cache=kv[:1]),
        "cache not contiguous": dict(ok, kv_cache=kv.transpose(2, 3)),
        "head_dim differs": dict(ok, q=q[:, :, :32].contiguous()),
        "heads not a multiple": dict(ok, q=torch.randn(2, 3, 64)),
        "block_size 0": dict(ok, block_size=0),
        "block_size float": dict(ok, block_size=4.0),
        "rows not whole blocks": dict(ok, block_size=3),
        "tables int32": dict(ok, block_tables=tables.int()),
        "tables batch": dict(ok, block_tables=tables[:1]),
        "lens 2-D": dict(ok, seq_lens=lens[:, None]),
        "lens int32": dict(ok, seq_lens=lens.int()),
        "scale nan": dict(ok, scale=float("nan")),
        "len 0": dict(ok, seq_lens=torch.tensor([0, 9])),
        "len past the table": dict(ok, seq_lens=torch.tensor([5, tables.shape[1] * 4 + 1])),
        "block id past the cache": dict(ok, block_tables=bad_table),
        "negative block id": dict(ok, block_tables=neg_table),
        "out shape": dict(ok, out=torch.empty(2, 4, 32)),
        "out dtype": dict(ok, out=torch.empty(2, 4, 64, dtype=torch.float64)),
    }


@needs_kernel
@pytest.mark.parametrize("case", list(_bad_inputs()))
def test_invalid_inputs_raise(case):
    with pytest.raises(ValueError):
        paged_decode_attention(**_bad_inputs()[case])


@needs_kernel
def test_kernel_checks_values_itself():
    """The compiled op refuses out-of-range lengths and block ids even when the Python checks are skipped."""
    args = _bad_inputs()
    op = cpu_paged._load_op()
    for case in ("len 0", "len past the table", "block id past the cache", "negative block id"):
        a = args[case]
        with pytest.raises(ValueError, match="cpu_paged"):
            op(
                a["q"],
                a["kv_cache"],
                a["block_tables"],
                a["seq_lens"],
                a["scale"],
                a["block_size"],
                torch.empty_like(a["q"]),
            )


# ------------------------------------------------------------------ the backend and the engine


@needs_kernel
def test_backend_matches_sdpa_on_a_mixed_step():
    """Prefills (one fresh, one chunked over cached tokens) then decodes: same output, same cache writes."""
    torch.manual_seed(0)
    h, hkv, d, bs, nb = 4, 2, 64, 4, 64
    cache = torch.randn(2, nb * bs, hkv, d)
    perm = torch.randperm(nb)
    fresh_len, chunk_q, chunk_ctx, dec_lens = 6, 3, 11, [1, 9, 20]
    tabs = [perm[0:2], perm[2:5], perm[5:6], perm[6:9], perm[9:14]]

    def slots(tab, start, end):
        return [int(tab[p // bs]) * bs + p % bs for p in range(start, end)]

    slot_mapping = (
        slots(tabs[0], 0, fresh_len)
        + slots(tabs[1], chunk_ctx - chunk_q, chunk_ctx)
        + [slots(tabs[2 + i], n - 1, n)[0] for i, n in enumerate(dec_lens)]
    )
    t = len(slot_mapping)
    table = torch.zeros(3, 5, dtype=torch.long)
    for i in range(3):
        table[i, : len(tabs[2 + i])] = tabs[2 + i]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping),
        block_size=bs,
        prefill_query_lens=[fresh_len, chunk_q],
        prefill_seq_lens=[fresh_len, chunk_ctx],
        prefill_block_tables=[tabs[0], tabs[1]],
        decode_seq_lens=torch.tensor(dec_lens),
        decode_block_tables=table,
        decode_max_seq_len=max(dec_lens),
    )
    q, k, v = torch.randn(t, h, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)
    c_ref, c_got = cache.clone(), cache.clone()
    ref = SdpaBackend().forward(q, k, v, c_ref, meta, d**-0.5)
    got = CpuPagedBackend().forward(q, k, v, c_got, meta, d**-0.5)
    assert torch.equal(c_ref, c_got)
    n_pf = fresh_len + chunk_q
    assert torch.equal(got[:n_pf], ref[:n_pf])  # the prefill path is SDPA's own
    assert _rel_err(got[n_pf:], ref[n_pf:]) <= 1e-5


@needs_kernel
def test_auto_picks_cpu_paged_on_cpu_and_sdpa_stays_selectable():
    assert get_attention_backend("auto", torch.device("cpu")).name == "cpu_paged"
    assert get_attention_backend("cpu_paged", torch.device("cpu")).name == "cpu_paged"
    assert get_attention_backend("sdpa", torch.device("cpu")).name == "sdpa"
    with pytest.raises(ValueError, match="CPU only"):
        get_attention_backend("cpu_paged", torch.device("meta"))


def test_unbuildable_kernel_falls_back_to_sdpa(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(cpu_paged, "_state", {})  # as if this process had not loaded it yet
    monkeypatch.setenv("DISTSERVE_TORCH_EXTENSIONS_DIR", str(tmp_path / "empty"))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with caplog.at_level("WARNING", logger=cpu_paged.__name__):
        assert not cpu_paged.available()
        assert not CpuPagedBackend.available()
    assert "no C++ compiler" in cpu_paged.unavailable_reason()
    assert sum("unavailable" in r.getMessage() for r in caplog.records) == 1  # logged once
    assert get_attention_backend("auto", torch.device("cpu")).name == "sdpa"
    with pytest.raises(ValueError, match="not available: .*no C\\+\\+ compiler"):
        get_attention_backend("cpu_paged", torch.device("cpu"))
    with pytest.raises(RuntimeError, match="unavailable"):
        CpuPagedBackend()


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setattr(cpu_paged, "_state", {})
    monkeypatch.setenv("DISTSERVE_DISABLE_CPU_PAGED", "1")
    assert not cpu_paged.available()
    assert "DISTSERVE_DISABLE_CPU_PAGED" in cpu_paged.unavailable_reason()
    assert get_attention_backend("auto", torch.device("cpu")).name == "sdpa"


@needs_kernel
@pytest.mark.slow
def test_builds_without_ninja(monkeypatch, tmp_path):
    """The direct compiler path (no ninja on the machine) builds, loads and agrees with the cached build."""
    monkeypatch.setattr(cpu_paged, "_state", {})
    monkeypatch.setattr(cpu_paged, "_ninja_available", lambda: False)
    monkeypatch.setattr(cpu_paged, "_build_key", lambda: "directbuildtest")  # a fresh op namespace
    monkeypatch.setenv("DISTSERVE_TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert cpu_paged.available(), cpu_paged.unavailable_reason()
    info = cpu_paged.build_info()
    assert info["cached"] is False and info["path"].startswith(str(tmp_path))
    q, kv, tables, lens, meta = _case([1, 50, 129], 4, 4, 64, 16)
    ref = SdpaBackend._decode(q, kv, meta, 0.125, False)
    assert _rel_err(paged_decode_attention(q, kv, tables, lens, 0.125, 16), ref) <= 1e-5


@needs_kernel
def test_engine_greedy_tokens_match_sdpa():
    """A mixed batch on the built-in tiny model; a small token budget chunks the prefills, so steps mix
    chunked prefills with decodes."""
    from distserve.server.engine.llm_engine import EngineConfig, LLMEngine
    from distserve.server.engine.sampling_params import SamplingParams

    prompts = [
        [1, 17, 42, 99, 5],
        list(range(1, 70)),
        [1, 9],
        [1] + [(7 * j) % 250 + 3 for j in range(150)],
        [1, 250, 3, 3, 3, 8, 19, 200, 101, 7, 64, 33, 12],
    ]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    out = {}
    for name in ("sdpa", "cpu_paged"):
        engine = LLMEngine(
            EngineConfig(attention_backend=name, block_size=16, num_blocks=128, max_num_batched_tokens=64)
        )
        assert engine.model.backend.name == name
        out[name] = engine.generate(prompts, params)
        assert engine.num_used_blocks == 0
    assert out["cpu_paged"] == out["sdpa"]
    assert all(len(t) == 24 for t in out["sdpa"])
