"""The KV pool sized from memory measured at start-up (server/engine/memory_profile.py): the order
(profiling forward, start-up graphs captured and measured, released, then the sizing), the arithmetic
(weights, activations, graphs, the share or the process limit), the MPS limit's parsing, the refusal's
sentence, and the same order inside a real (CPU) engine. Only the device query is faked: ``Ledger``
plays the device's memory counters, and the test's steps allocate into it what a GPU would."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import replace

import pytest

from distserve.server.config import DistServeConfig
from distserve.server.engine.kv_sizing import MemoryBudgetError
from distserve.server.engine.llm_engine import EngineConfig, LLMEngine
from distserve.server.engine.memory_profile import SizingInputs, pinned_limit_bytes, size_kv_pool
from distserve.server.engine.sampling_params import SamplingParams
from distserve.server.launcher import Launcher, StartupRefused
from distserve.server.workers.worker import engine_config_for, process_limit_bytes

MiB, GiB = 2**20, 2**30
BLOCK = 8 * MiB


class Ledger:
    """A device's memory counters as torch.cuda would report them to one process: torch's allocated and
    reserved bytes, memory this process holds outside torch, and what other processes hold."""

    def __init__(self, total=141 * GiB, others=0, context=512 * MiB):
        self.total, self.others, self.context = total, others, context
        self.held = self.cached = self.outside = self.peak = 0
        self.calls: list[str] = []

    # what the test's "device work" does
    def alloc(self, n: int) -> None:
        self.held += n
        self.peak = max(self.peak, self.held)

    def free(self, n: int) -> None:
        self.held -= n
        self.cached += n  # the caching allocator keeps it until empty_cache

    # the probe's interface (server.engine.memory_profile.MemoryProbe)
    def synchronize(self) -> None:
        self.calls.append("sync")

    def empty_cache(self) -> None:
        self.cached = 0

    def mem_info(self) -> tuple[int, int]:
        used = self.context + self.held + self.cached + self.outside + self.others
        return self.total - used, self.total

    def allocated(self) -> int:
        return self.held

    def reserved(self) -> int:
        return self.held + self.cached

    def max_allocated(self) -> int:
        return self.peak

    def reset_peak(self) -> None:
        self.peak = self.held


def run_sizing(
    dev: Ledger,
    *,
    weights=13 * GiB,
    activations=2 * GiB,
    graphs=700 * MiB,
    graphs_outside=60 * MiB,
    small_cache=130 * BLOCK,
    leak=0,
    **inputs,
):
    """The engine's sequence against ``dev``: weights loaded, then size_kv_pool with steps that allocate what
    a GPU worker's steps would (a profiling forward's activations, graph pools and graph executables)."""
    free_at_start = dev.mem_info()[0]
    dev.alloc(weights)
    order = []

    def profile():
        order.append("profile")
        dev.alloc(small_cache)
        dev.alloc(activations)
        dev.free(activations)
        return small_cache

    def setup():
        order.append("setup")
        dev.alloc(graphs)
        dev.outside += graphs_outside

    def teardown():
        order.append("teardown")
        dev.free(graphs - leak)
        dev.outside -= graphs_outside

    def drop_cache():
        order.append("drop_cache")
        dev.free(small_cache)

    args = dict(utilization=0.27, block_bytes=BLOCK, min_blocks=256, profile_tokens=2048) | inputs
    budget, rep = size_kv_pool(dev, SizingInputs(**args), free_at_start, weights, profile, setup, teardown, drop_cache)
    return budget, rep, order


def test_graphs_are_measured_before_the_pool_is_sized_and_come_out_of_it():
    budget, rep, order = run_sizing(Ledger())
    assert order == ["profile", "setup", "teardown", "drop_cache"]
    assert rep.phases == ["profile", "setup", "teardown", "drop_cache", "size"]
    assert rep.weights == 13 * GiB and rep.peak == 15 * GiB  # weights + the forward's activations
    assert rep.startup_measured == 760 * MiB  # graph pools + what the graphs hold outside torch
    share = int(141 * GiB * 0.27)
    assert budget.num_blocks == (share - 15 * GiB - 760 * MiB) // BLOCK
    without, _, _ = run_sizing(Ledger(), graphs=0, graphs_outside=0)
    assert without.num_blocks - budget.num_blocks == 760 * MiB // BLOCK  # exactly the measured graphs
    assert "graphs 0.74 GiB measured" in rep.describe(budget) and "at 2048 tokens" in rep.describe(budget)


def test_graphs_that_stay_allocated_after_teardown_are_still_counted():
    clean, _, _ = run_sizing(Ledger())
    leaky, rep, _ = run_sizing(Ledger(), leak=200 * MiB)
    assert rep.startup_measured == 960 * MiB  # taken again by the final set-up, + 200 never released
    assert clean.num_blocks - leaky.num_blocks == 200 * MiB // BLOCK


def test_a_process_limit_below_the_share_caps_the_pool():
    share, _, _ = run_sizing(Ledger())
    limited, rep, _ = run_sizing(Ledger(), process_limit=35 * GiB)
    assert limited.num_blocks == (35 * GiB - 15 * GiB - 760 * MiB) // BLOCK < share.num_blocks
    assert limited.budget_bytes == 35 * GiB and "process limit 35.00 GiB" in limited.describe()
    assert limited.to_dict()["limit_mib"] == 35 * 1024
    # a limit above the share changes nothing
    assert run_sizing(Ledger(), process_limit=60 * GiB)[0].num_blocks == share.num_blocks


def test_what_other_processes_hold_is_not_this_workers_but_caps_what_is_free():
    alone, _, _ = run_sizing(Ledger())
    crowded, _, _ = run_sizing(Ledger(others=110 * GiB))
    assert crowded.non_torch_bytes == alone.non_torch_bytes == 0
    assert crowded.num_blocks < alone.num_blocks  # capped by the device's free memory, not the share


def test_a_share_that_cannot_hold_weights_and_activations_refuses_naming_the_numbers():
    # 7B bf16 at a 0.1 share of an H200 (14.1 GiB): weights 13 GiB + 2 GiB activations do not fit
    with pytest.raises(MemoryBudgetError) as e:
        run_sizing(Ledger(), utilization=0.1)
    msg = str(e.value)
    assert "\n" not in msg and msg.count(". ") == 0
    for part in ("weights (13.00 GiB)", "activations (2.00 GiB at 2048 tokens)", "CUDA graphs (0.74 GiB"):
        assert part in msg
    assert "max_num_batched_tokens" in msg and "memory_share" in msg


@pytest.mark.parametrize(
    "value,index,expected",
    [
        ("0=39842M", 0, 39842 * MiB),
        ("1=2G,0=512M", 0, 512 * MiB),
        ("1=2G,0=512M", 1, 2 * GiB),
        ("4G", 3, 4 * GiB),
        ("0=1024", 0, 1024),
        ("1=2G", 0, None),
        ("", 0, None),
        (None, 0, None),
    ],
)
def test_mps_pinned_limit_parsing(value, index, expected):
    assert pinned_limit_bytes(value, index) == expected


def test_a_malformed_mps_limit_is_an_error_naming_it():
    with pytest.raises(ValueError, match="'0=lots'"):
        pinned_limit_bytes("0=lots")


def test_the_worker_sizes_inside_its_mps_limit_less_the_context():
    env = {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=39842M"}
    assert process_limit_bytes("cuda:0", env) == (39842 - 1024) * MiB
    assert process_limit_bytes("cuda", env) == (39842 - 1024) * MiB
    assert process_limit_bytes("cuda:1", env) == 0 and process_limit_bytes("cuda:0", {}) == 0


def test_the_prefill_role_reserves_one_gathered_prompt_and_captures_no_decode_graphs():
    cfg = DistServeConfig.from_dict({})
    pf = engine_config_for("prefill", cfg, "cuda:0", 0.27)
    dc = engine_config_for("decode", cfg, "cuda:0", 0.63)
    assert pf.kv_receive_tokens == cfg.prefill.max_seq_len and not pf.decode_graphs
    assert dc.kv_receive_tokens == 2 * cfg.prefill.max_num_batched_tokens and dc.decode_graphs


def test_a_cpu_engine_sized_through_the_probe_runs_the_order_and_serves():
    """The real engine (tiny model, CPU) with the device query faked: its profiling forward runs, the pool
    it builds has the blocks the sizing chose, and it generates afterwards."""
    dev = Ledger(total=GiB, context=0)
    cfg = EngineConfig(
        device="cpu",
        gpu_memory_utilization=0.1,
        max_num_batched_tokens=64,
        max_model_len=128,
        gpu_memory_headroom_bytes=16 * MiB,
    )
    engine = LLMEngine(cfg, memory_probe=dev)
    rep, budget = engine.startup_memory, engine.kv_budget
    assert rep is not None and budget is not None
    assert rep.phases == ["profile", "setup", "teardown", "drop_cache", "size"]
    assert rep.profile_tokens == 64
    assert engine.block_manager.num_blocks == budget.num_blocks
    assert budget.num_blocks == (int(GiB * 0.1) - 16 * MiB) // budget.block_bytes  # nothing else on this "device"
    out = engine.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0]) == 3 and engine.num_used_blocks == 0
    with pytest.raises(MemoryBudgetError, match="process limit"):
        LLMEngine(replace(cfg, gpu_process_limit_bytes=MiB), memory_probe=Ledger(total=GiB, context=0))


def test_the_launcher_repeats_a_worker_refusal_sentence(tmp_path):
    la = Launcher(DistServeConfig.from_dict({}), "disaggregated", 1, 1, "t", pinning="none", log_dir=tmp_path)
    try:
        said = "prefill-0: no room for the KV cache: weights (13.00 GiB) and activations (2.00 GiB at 4096 tokens)"
        code = f"print('distserve worker: error: {said}', flush=True); raise SystemExit(2)"
        with open(tmp_path / "prefill-0.log", "wb") as out:
            p = subprocess.Popen([sys.executable, "-c", code, "--worker-id", "prefill-0"], stdout=out)
        p.wait()
        la.procs.append(p)
        with pytest.raises(StartupRefused) as e:
            la.wait_healthy(1, time.monotonic() + 60)
        assert str(e.value) == said
    finally:
        la.procs.clear()
        la._tmp.cleanup()
