"""The KV pool sized from memory measured at start-up, on a real GPU (server/engine/memory_profile.py): the
graphs measured before the sizing predict what the final set-up keeps, and the engine stays inside its share
through its largest step. Skipped without CUDA; on the H200:
``python3 -m pytest tests/gpu/test_startup_memory.py -q`` (tiny model; about a minute)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
MiB = 2**20


def _engine(**kw):
    from distserve.server.engine.llm_engine import EngineConfig, LLMEngine

    cfg = dict(device="cuda", gpu_memory_utilization=0.2, max_num_batched_tokens=1024, max_model_len=2048) | kw
    return LLMEngine(EngineConfig(**cfg))


def test_graphs_measured_before_sizing_predict_the_final_ones_and_the_share_holds():
    from distserve.server.engine.memory_profile import MemoryProbe, process_used
    from distserve.server.engine.sampling_params import SamplingParams

    engine = _engine()
    rep, budget = engine.startup_memory, engine.kv_budget
    assert rep is not None and budget is not None
    assert rep.phases == ["profile", "setup", "teardown", "drop_cache", "size"]
    assert engine.runner.graph_runner is not None and engine.sampler.graphs is not None
    assert rep.startup_measured > 0  # decode and sampler graphs were captured and measured
    # what the final set-up kept is what was measured over the profiling cache (its decode tuning aside)
    assert rep.startup_final <= rep.startup_measured + 128 * MiB, rep.to_dict()
    probe = MemoryProbe(engine.device)
    torch.cuda.reset_peak_memory_stats()
    engine.add_request("big", [1] * 1024, SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    peak = torch.cuda.max_memory_reserved()
    used = process_used(probe, engine._free_at_start)
    assert max(used, peak) <= budget.budget_bytes, (used >> 20, peak >> 20, budget.to_dict())
    assert "start-up memory" in rep.describe(budget)


def test_a_prefill_engine_captures_no_decode_graphs_but_samples_through_graphs():
    engine = _engine(decode_graphs=False)
    assert engine.runner.graph_runner is None
    assert engine.sampler.graphs is not None
    assert "decode" not in engine._tuned
