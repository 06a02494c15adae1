"""Block manager, scheduler and sampler behaviour on the real built-in tiny model.

Every engine test ends with the leak check: no block in use, every ref count
zero, the free list consistent.
"""

from __future__ import annotations

import pytest
import torch

from distserve.server.engine.block_manager import BlockManager
from distserve.server.engine.llm_engine import EngineConfig, LLMEngine
from distserve.server.engine.sampling_params import SamplingParams
from distserve.server.engine.sequence import Sequence, SequenceStatus

PROMPTS = [[1] + [(7 * i + 13 * j) % 500 + 3 for j in range(n)] for i, n in enumerate([7, 12, 3, 9, 15, 5])]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def assert_engine_empty(engine: LLMEngine) -> None:
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_used_blocks == 0
    assert all(c == 0 for c in bm.ref_counts)
    assert not engine.scheduler.has_work()
    assert not engine.requests


@pytest.fixture(scope="module")
def big_engine():
    return LLMEngine(EngineConfig(block_size=4, num_blocks=512))


@pytest.fixture(scope="module")
def reference():
    # computed without prefix caching: the tests below run with it on (the default)
    engine = LLMEngine(EngineConfig(block_size=4, num_blocks=512, enable_prefix_caching=False))
    return [engine.generate([p], GREEDY)[0] for p in PROMPTS]


def test_preemption_by_recompute_gives_identical_tokens(reference):
    # 10 blocks x 4 slots: each request needs up to 8 blocks, so they cannot all run at once.
    engine = LLMEngine(EngineConfig(block_size=4, num_blocks=10, max_num_seqs=8))
    got = engine.generate(PROMPTS, GREEDY)
    assert got == reference
    assert engine.stats.num_preemptions > 0
    assert_engine_empty(engine)


def test_chunked_prefill_under_small_token_budget(reference):
    engine = LLMEngine(EngineConfig(block_size=4, num_blocks=256, max_num_batched_tokens=5))
    assert engine.generate(PROMPTS, GREEDY) == reference
    assert_engine_empty(engine)


def test_request_larger_than_pool_is_aborted_not_hung():
    engine = LLMEngine(EngineConfig(block_size=4, num_blocks=3))
    engine.add_request("big", list(range(3, 40)), GREEDY)
    engine.add_request("small", [1, 5, 6], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    finished = {}
    for _ in range(100):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.finish_reason
        if not engine.has_unfinished_requests():
            break
    assert finished == {"big": "abort", "small": "length"}
    assert_engine_empty(engine)


def test_a_request_that_fits_the_pool_waits_while_its_blocks_are_leased_out(reference):
    # KV by reference: the decode worker's lessor has taken blocks for hand-offs not yet adopted. A request
    # that fits the pool but not what is left waits for them; before, it was failed as larger than the pool.
    engine = LLMEngine(EngineConfig(block_size=4, num_blocks=10, max_num_seqs=8))
    bm = engine.block_manager
    leased = bm.take_blocks(8)
    assert leased is not None and bm.num_leased == 8
    engine.add_request("r", PROMPTS[4], GREEDY)  # 15 + 16 tokens: 8 of the 10 blocks at the end
    for _ in range(5):
        assert not any(o.finished for o in engine.step())  # nothing runs, nothing fails
    assert engine.scheduler.has_work()
    bm.give_back(leased)  # the lease expired (or was released)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
            assert out.finish_reason in (None, "length"), out
    assert tokens == reference[4] and bm.num_leased == 0
    assert_engine_empty(engine)
    # larger than the whole pool is still failed at once, leases or not
    held = bm.take_blocks(1)
    engine.add_request("big", list(range(3, 60)), GREEDY)
    assert [o.finish_reason for o in engine.step()] == ["abort"]
    bm.give_back(held)
    assert_engine_empty(engine)


def test_abort_mid_generation_frees_blocks(big_engine):
    big_engine.add_request("a", PROMPTS[1], GREEDY)
    big_engine.add_request("b", PROMPTS[2], GREEDY)
    for _ in range(3):
        big_engine.step()
    assert big_engine.num_used_blocks > 0
    assert big_engine.abort_request("a")
    assert not big_engine.abort_request("a")
    while big_engine.has_unfinished_requests():
        big_engine.step()
    assert_engine_empty(big_engine)


def test_seeded_sampling_is_reproducible_across_batching_and_preemption():
    # top_k rows, top_p-only rows (the CPU nucleus) with penalties, and min_p rows, mixed in one batch
    kinds = [
        dict(top_p=0.9, top_k=50),
        dict(top_p=0.8, frequency_penalty=0.7, presence_penalty=0.2, repetition_penalty=1.2),
        dict(min_p=0.05, logit_bias=((7, 2.0),)),
    ]
    params = [
        SamplingParams(max_tokens=12, temperature=0.9, seed=100 + i, ignore_eos=True, **kinds[i % 3])
        for i in range(len(PROMPTS))
    ]
    solo = LLMEngine(EngineConfig(block_size=4, num_blocks=512))
    alone = [solo.generate([p], [sp])[0] for p, sp in zip(PROMPTS, params)]
    tight = LLMEngine(EngineConfig(block_size=4, num_blocks=9))
    assert tight.generate(PROMPTS, params) == alone
    assert tight.stats.num_preemptions > 0
    other_seed = solo.generate([PROMPTS[0]], [SamplingParams(max_tokens=12, temperature=0.9, seed=7, ignore_eos=True)])
    assert other_seed[0] != alone[0]
    assert_engine_empty(tight)


def test_top_k_1_and_tiny_top_p_are_greedy(big_engine, reference):
    k1 = SamplingParams(max_tokens=16, temperature=1.0, top_k=1, seed=3, ignore_eos=True)
    p0 = SamplingParams(max_tokens=16, temperature=1.0, top_p=1e-6, seed=3, ignore_eos=True)
    assert big_engine.generate(PROMPTS[:2], k1) == reference[:2]
    assert big_engine.generate(PROMPTS[:2], p0) == reference[:2]


def test_stop_token_ids_and_eos(big_engine, reference):
    stop_at = reference[0][5]
    first = reference[0].index(stop_at)
    params = SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=(stop_at,))
    assert big_engine.generate([PROMPTS[0]], params)[0] == reference[0][: first + 1]


def test_prefill_then_transfer_then_decode_equals_colocated(reference):
    """The disaggregation seam in one process: prefill-only engine -> KV tensor -> decode engine."""
    prefill = LLMEngine(EngineConfig(block_size=4, num_blocks=64))
    decode = LLMEngine(EngineConfig(block_size=8, num_blocks=64))  # a different block size on purpose
    for i, prompt in enumerate(PROMPTS):
        rid = f"r{i}"
        prefill.add_request(rid, prompt, GREEDY, prefill_only=True)
        outs = []
        while not outs:
            outs = [o for o in prefill.step() if o.request_id == rid]
        assert outs[0].finish_reason == "prefilled"
        seq, kv = prefill.take_prefilled_kv(rid)
        assert kv.shape[2] == len(prompt)
        assert decode.reserve_prefilled(rid, prompt, seq.output_token_ids, GREEDY)
        assert decode.requests[rid].status is SequenceStatus.WAITING_FOR_REMOTE_KVS and rid in decode.awaiting_kv
        decode.commit_prefilled(rid, kv)
        assert decode.requests[rid].status is SequenceStatus.RUNNING and not decode.awaiting_kv
        tokens = list(seq.output_token_ids)
        while decode.has_unfinished_requests():
            for o in decode.step():
                tokens.extend(o.new_token_ids)
        assert tokens == reference[i]
    assert_engine_empty(prefill)
    assert_engine_empty(decode)


def test_prefilled_admission_applies_back_pressure():
    decode = LLMEngine(EngineConfig(block_size=4, num_blocks=2))
    kv = torch.zeros(decode.runner.kv_shape(10))
    assert not decode.reserve_prefilled("x", list(range(3, 13)), [5], GREEDY)  # does not fit now
    assert_engine_empty(decode)
    assert decode.reserve_prefilled("y", [3, 4], [5], GREEDY)
    with pytest.raises(ValueError, match="shape"):
        decode.commit_prefilled("y", kv)
    assert decode.requests["y"].status is SequenceStatus.WAITING_FOR_REMOTE_KVS
    assert decode.abort_request("y")
    assert_engine_empty(decode)
    with pytest.raises(KeyError, match="no reservation"):
        decode.commit_prefilled("y", kv)


def test_bad_prompts_rejected_with_the_reason():
    engine = LLMEngine(EngineConfig(block_size=4, num_blocks=16, max_model_len=32))
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.add_request("long", list(range(3, 40)), GREEDY)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("oov", [1, 99999], GREEDY)
    with pytest.raises(ValueError, match="at least one token"):
        engine.add_request("empty", [], GREEDY)


class TestBlockManager:
    def test_shared_blocks_are_freed_by_their_last_owner(self):
        bm = BlockManager(8, 4, enable_prefix_caching=True)
        tokens = list(range(1, 14))  # 13 tokens: 3 full blocks
        a, b = Sequence("a", tokens, GREEDY), Sequence("b", tokens, GREEDY)
        bm.grow(a, 13)
        a.num_computed_tokens = 13
        bm.register(a)
        assert len(a.block_table) == 4 and bm.num_free_blocks == 4
        assert bm.claim_prefix(b) == 12  # shares a's 3 full blocks
        assert all(bm.ref_counts[x] == 2 for x in a.block_table[:3])
        bm.free(a)
        assert bm.num_free_blocks == 5  # a's last block only: the shared ones are still held by b
        bm.free(b)
        assert bm.num_free_blocks == 8
        bm.check_invariants()

    def test_grow_beyond_capacity_raises(self):
        bm = BlockManager(2, 4)
        s = Sequence("s", [1], GREEDY)
        assert not bm.can_grow(s, 9)
        with pytest.raises(RuntimeError, match="out of KV blocks"):
            bm.grow(s, 9)
        assert bm.num_free_blocks == 2

    def test_double_free_detected(self):
        bm = BlockManager(2, 4)
        s = Sequence("s", [1], GREEDY)
        bm.grow(s, 4)
        table = list(s.block_table)
        bm.free(s)
        s.block_table = table
        with pytest.raises(RuntimeError, match="double free"):
            bm.free(s)
