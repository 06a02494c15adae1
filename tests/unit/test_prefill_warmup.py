"""The start-up prefill a worker times for the router's cold-start prior (``LLMEngine.measure_prefill``, tiny
model on the CPU) and its config key."""

from __future__ import annotations

import pytest

from distserve.server.config import ConfigError, load_config
from distserve.server.engine.llm_engine import EngineConfig, LLMEngine
from distserve.server.engine.sampling_params import SamplingParams


def test_the_warmup_prefill_is_timed_within_the_budgets_and_leaves_nothing_behind():
    e = LLMEngine(EngineConfig(max_num_seqs=3, max_num_batched_tokens=1000, enable_prefix_caching=True))
    free = e.block_manager.num_free_blocks
    w = e.measure_prefill(5000)
    assert w is not None and w["ms"] > 0
    assert (w["requests"], w["tokens"]) == (3, 3 * 256)  # prompts of 256 tokens, at most 3 per batch, 1000 tokens
    assert e.requests == {} and not e.has_unfinished_requests() and e.stats.num_steps == 0
    assert e.block_manager.num_free_blocks == free and e.block_manager.cache_version == 0  # nothing cached
    assert e.measure_prefill(0) is None  # prefill.warmup_tokens 0: nothing measured, no prior
    e.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))  # and it serves as before
    out = []
    while e.has_unfinished_requests():
        out += [o for o in e.step() if o.request_id == "r"]
    assert out and out[-1].num_output_tokens == 2 and out[-1].finished
    w = e.measure_prefill(100)
    assert w is not None and (w["tokens"], w["requests"]) == (100, 1) and e.requests == {}


def test_the_warmup_prefill_fits_a_small_kv_pool():
    e = LLMEngine(EngineConfig(num_blocks=10, block_size=16, max_num_seqs=8, max_num_batched_tokens=4096))
    w = e.measure_prefill(512)
    # one prompt and its first token in the 10 blocks (at most 9 x 16 - 1 tokens), not 2 that could not fit
    assert w is not None and (w["tokens"], w["requests"]) == (143, 1)
    assert e.block_manager.num_free_blocks == 10 and e.requests == {}


def test_the_warmup_key_is_validated_once_in_the_typed_config():
    assert load_config().prefill.warmup_tokens == 512
    assert load_config(None, {"prefill": {"warmup_tokens": 0}}).prefill.warmup_tokens == 0
    with pytest.raises(ConfigError, match="prefill.warmup_tokens"):
        load_config(None, {"prefill": {"warmup_tokens": -1}})


def test_the_warmup_decode_steps_are_timed_within_the_batch_and_leave_nothing_behind():
    e = LLMEngine(EngineConfig(max_num_seqs=3, enable_prefix_caching=True))
    free = e.block_manager.num_free_blocks
    w = e.measure_decode(8)
    assert w is not None and (w["batch"], w["steps"]) == (3, 4) and w["ms"] > 0 and w["ms_batch1"] > 0
    assert e.requests == {} and not e.has_unfinished_requests() and e.stats.num_steps == 0
    assert e.block_manager.num_free_blocks == free and e.block_manager.cache_version == 0
    assert e.measure_decode(0) is None  # decode.warmup_batch 0: nothing measured, no prior
    e.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    assert e.measure_decode(2) is None  # never while requests are in the engine
    while e.has_unfinished_requests():
        e.step()
    small = LLMEngine(EngineConfig(num_blocks=4, block_size=16, max_num_seqs=8))
    w = small.measure_decode(8)  # 16 + 6 tokens a sequence: 2 blocks, so 2 sequences fit in 4 blocks
    assert w is not None and w["batch"] == 2 and small.block_manager.num_free_blocks == 4


def test_the_decode_warmup_key_is_validated_once_in_the_typed_config():
    assert load_config().decode.warmup_batch == 8
    with pytest.raises(ConfigError, match="decode.warmup_batch"):
        load_config(None, {"decode": {"warmup_batch": -1}})
