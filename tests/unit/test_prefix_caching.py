"""Prefix caching: cached KV must give the same tokens and KV as computing it, and never leak.

Real tiny model; each reference comes from an engine with prefix caching off.
"""

from __future__ import annotations

import random

import pytest
import torch

from distserve.server.engine.block_manager import BlockManager, block_digest
from distserve.server.engine.llm_engine import EngineConfig, LLMEngine
from distserve.server.engine.sampling_params import SamplingParams
from distserve.server.engine.sequence import Sequence
from tests.unit.test_engine_scheduling import assert_engine_empty

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
BASE = [1] + [(11 * j + 5) % 500 + 3 for j in range(37)]  # 38 tokens: 9 full blocks of 4 + 2
# Shared prefixes of several lengths (block-aligned and not), identical prompts, and strangers.
PROMPTS = [
    BASE,
    BASE,  # identical: all but the last block reused
    BASE[:36],  # exactly 9 blocks: 8 reused, last block recomputed
    BASE[:17] + [400, 401, 402, 403, 404],
    BASE[:9],
    [1] + [(3 * j + 2) % 500 + 3 for j in range(20)],
    BASE + [77, 78, 79],
]


@pytest.fixture(scope="module")
def reference():
    engine = LLMEngine(EngineConfig(block_size=4, num_blocks=512, enable_prefix_caching=False))
    out = [engine.generate([p], GREEDY)[0] for p in PROMPTS]
    assert engine.block_manager.num_cache_hits == 0
    return out


def test_sequential_requests_hit_the_cache_and_match(reference):
    engine = LLMEngine(EngineConfig(block_size=4, num_blocks=512))
    got = [engine.generate([p], GREEDY)[0] for p in PROMPTS]
    assert got == reference
    bm = engine.block_manager
    # request 2 alone reuses 9 blocks (36 tokens); everything after BASE reuses something
    assert bm.num_cache_hits >= 36 + 32 + 16 + 8 + 36
    prompt_tokens_computed = engine.stats.num_prompt_tokens
    assert prompt_tokens_computed < sum(len(p) for p in PROMPTS) - 100
    assert bm.num_cached_blocks > 0
    assert_engine_empty(engine)


def test_batched_and_chunked_with_cache_match(reference):
    # all at once (the cache fills while they run) and again (warm), under a small token budget
    engine = LLMEngine(EngineConfig(block_size=4, num_blocks=512, max_num_batched_tokens=7))
    assert engine.generate(PROMPTS, GREEDY) == reference
    assert engine.generate(PROMPTS, GREEDY) == reference
    assert engine.block_manager.num_cache_hits > 0
    assert_engine_empty(engine)


def test_small_pool_evicts_and_preempts_correctly(reference):
    # 14 blocks of 4 slots: a 50-token request needs 13, so cached blocks must be evicted and
    # running requests preempted; recompute after preemption may itself hit the cache
    engine = LLMEngine(EngineConfig(block_size=4, num_blocks=14, max_num_seqs=8))
    for _ in range(2):
        assert engine.generate(PROMPTS, GREEDY) == reference
    assert engine.stats.num_preemptions > 0
    assert_engine_empty(engine)


def test_seeded_sampling_unchanged_by_cache_hits():
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=1234, ignore_eos=True)
    cold = LLMEngine(EngineConfig(block_size=4, num_blocks=256, enable_prefix_caching=False))
    warm = LLMEngine(EngineConfig(block_size=4, num_blocks=256))
    want = cold.generate([BASE], params)
    warm.generate([BASE[:30]], params)
    assert warm.generate([BASE], params) == want
    assert warm.generate([BASE], params) == want
    assert warm.block_manager.num_cache_hits >= 28


def test_prefilled_kv_from_cache_equals_computed_kv():
    """Disaggregated path: the KV a prefill worker ships is the same whether it came from the
    cache or from compute (float32, tiny model)."""
    cold = LLMEngine(EngineConfig(block_size=4, num_blocks=256, enable_prefix_caching=False))
    warm = LLMEngine(EngineConfig(block_size=4, num_blocks=256))

    def prefill(engine, rid):
        engine.add_request(rid, BASE, GREEDY, prefill_only=True)
        first = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                first = out.new_token_ids[0]
        seq, kv = engine.take_prefilled_kv(rid)
        return first, kv

    t_cold, kv_cold = prefill(cold, "a")
    prefill(warm, "w1")
    t_warm, kv_warm = prefill(warm, "w2")
    assert warm.block_manager.num_cache_hits >= 36
    assert t_warm == t_cold
    torch.testing.assert_close(kv_warm, kv_cold, rtol=1e-5, atol=1e-5)
    assert_engine_empty(warm)


def test_abort_of_a_request_holding_shared_blocks_keeps_the_other_correct(reference):
    engine = LLMEngine(EngineConfig(block_size=4, num_blocks=512))
    engine.generate([BASE], GREEDY)
    engine.add_request("x", BASE, GREEDY)
    engine.add_request("y", BASE, GREEDY)
    tokens = [t for out in engine.step() if out.request_id == "y" for t in out.new_token_ids]
    assert engine.abort_request("x")
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
    assert tokens == reference[0]
    assert_engine_empty(engine)


# --- the block manager alone ------------------------------------------------------------
def _seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, list(tokens), GREEDY)


def test_digest_names_the_whole_prefix():
    a = block_digest(b"root", [1, 2, 3, 4])
    assert a == block_digest(b"root", [1, 2, 3, 4])
    assert a != block_digest(b"root", [1, 2, 3, 5])
    assert block_digest(a, [5, 6, 7, 8]) != block_digest(block_digest(b"root", [9, 2, 3, 4]), [5, 6, 7, 8])


def test_block_manager_random_workload_keeps_invariants():
    rng = random.Random(7)
    bm = BlockManager(num_blocks=40, block_size=4, enable_prefix_caching=True)
    prefixes = [[rng.randrange(500) for _ in range(rng.randrange(4, 30))] for _ in range(5)]
    live: list[Sequence] = []
    for step in range(600):
        if live and rng.random() < 0.45:
            seq = live.pop(rng.randrange(len(live)))
            bm.free(seq)
        else:
            tokens = rng.choice(prefixes)[: rng.randrange(1, 30)] + [
                rng.randrange(500) for _ in range(rng.randrange(0, 6))
            ]
            seq = _seq(f"s{step}", tokens or [1])
            cached = bm.claim_prefix(seq)
            assert cached % 4 == 0 and cached < seq.num_tokens
            if not bm.can_grow(seq, seq.num_tokens):
                bm.free(seq)
                continue
            bm.grow(seq, seq.num_tokens)
            bm.record_lookup(seq.num_tokens, cached)
            seq.num_computed_tokens = seq.num_tokens
            bm.register(seq)
            # every cached block of this sequence is named by its own prefix
            for i, block in enumerate(seq.block_table[: seq.num_tokens // 4]):
                digest = bm._digest_of.get(block)
                if digest is not None:
                    assert digest == seq.block_digests[i]
            live.append(seq)
        bm.check_invariants()
    for seq in live:
        bm.free(seq)
    bm.check_invariants()
    assert bm.num_used_blocks == 0
    assert bm.num_cache_hits > 0


def test_eviction_takes_a_cached_prefix_from_its_tail():
    bm = BlockManager(num_blocks=3, block_size=4, enable_prefix_caching=True)
    owner = _seq("a", list(range(1, 14)))  # 13 tokens: 3 full blocks cover 12
    bm.grow(owner, 12)
    owner.num_computed_tokens = 12
    bm.register(owner)
    bm.free(owner)
    other = _seq("b", [400, 401, 402])
    bm.grow(other, 3)  # the pool has only cached blocks left: one is evicted
    again = _seq("c", list(range(1, 14)))
    assert bm.claim_prefix(again) == 8  # the first two blocks still match
    bm.check_invariants()


def test_lookup_counted_once_per_admission_not_per_retry():
    engine = LLMEngine(EngineConfig(block_size=4, num_blocks=16, max_num_seqs=4))
    engine.generate([BASE[:21]], GREEDY)  # 33 tokens: its full blocks stay cached (evictable)
    engine.add_request("big", [7] * 52, GREEDY)  # 13 blocks at admission, all 16 by its end
    engine.add_request("hit", BASE[:21], GREEDY)  # never fits beside it: claimed, given back, retried
    waited = 0
    while engine.has_unfinished_requests():
        engine.step()
        waited += engine.scheduler.num_waiting
    bm = engine.block_manager
    assert waited >= 3  # "hit" sat in the queue for several steps
    assert engine.stats.num_preemptions == 0
    assert bm.num_cache_queries == 21 + 52 + 21  # one lookup per admission
    assert bm.num_cache_hits <= 20
    assert_engine_empty(engine)


def test_graph_runner_rows_follow_a_table_rebuilt_after_preemption():
    """The CUDA-graph decode path caches each host row of its block table; after preemption
    and re-admission through the prefix cache a sequence can have a table of the same length
    with other block ids. Run the graph runner's static-buffer code eagerly on the CPU
    (use_graphs=False) and compare with the plain runner, with caching on and off."""
    from distserve.server.engine.cuda_graph_runner import CudaGraphRunner

    prompts = [[1, 46, 336, 238, 14, 72, 156, 368, 277, 155, 392], [1, 46, 336, 238, 301, 176, 345, 93, 272]]
    params = SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True)

    def run(graph: bool, caching: bool):
        eng = LLMEngine(
            EngineConfig(block_size=4, num_blocks=8, enable_prefix_caching=caching, max_num_batched_tokens=64)
        )
        if graph:
            eng.runner.graph_runner = CudaGraphRunner(
                eng.runner, eng.max_model_len, batch_sizes=[1, 2], use_graphs=False
            )
        out = eng.generate(prompts, params)
        assert_engine_empty(eng)
        return out, eng.stats.num_preemptions

    for caching in (False, True):
        (eager, p_eager), (graphed, p_graph) = run(False, caching), run(True, caching)
        assert p_eager > 0 and p_graph > 0
        assert graphed == eager, caching
