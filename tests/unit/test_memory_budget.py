"""GPU memory budget of workers that share a device: the split of
cache.gpu_memory_utilization by role, the per-worker sizing inside a share (reserved memory,
headroom, refusal), and what the launcher hands each worker — with fake device numbers."""

import json
from pathlib import Path

import pytest

from distserve.server.config import DistServeConfig
from distserve.server.engine.kv_sizing import MemoryBudgetError, kv_blocks_from_memory
from distserve.server.launcher import Launcher, plan_workers
from distserve.server.memory_budget import device_key, plan_memory_shares, shared_devices
from distserve.server.workers.worker import engine_config_for

GiB, MiB = 2**30, 2**20
H200 = int(139.8 * GiB)
CFG = DistServeConfig()


def test_one_prefill_one_decode_split_the_device_budget_by_role():
    plan = plan_workers("disaggregated", 1, 1, "cuda")
    shares = plan_memory_shares(plan, CFG)
    assert shares == {"prefill-0": pytest.approx(0.27), "decode-1": pytest.approx(0.63)}
    assert sum(shares.values()) == pytest.approx(CFG.cache.gpu_memory_utilization)
    assert shared_devices(plan) == {"cuda:0"}


def test_one_prefill_two_decode_on_one_gpu():
    shares = plan_memory_shares(plan_workers("disaggregated", 1, 2, "cuda:0"), CFG)
    assert shares["prefill-0"] == pytest.approx(0.9 * 0.3 / 1.7, abs=1e-6)
    assert shares["decode-1"] == shares["decode-2"] == pytest.approx(0.9 * 0.7 / 1.7, abs=1e-6)
    assert sum(shares.values()) <= 0.9 + 1e-6


def test_a_worker_alone_on_its_gpu_gets_the_whole_budget_and_cpu_workers_none():
    assert plan_memory_shares(plan_workers("colocated", 1, 1, "cuda"), CFG) == {"colocated-0": 0.9}
    two = plan_memory_shares(plan_workers("disaggregated", 1, 1, "cpu", ("cuda:0", "cuda:1")), CFG)
    assert two == {"prefill-0": 0.9, "decode-1": 0.9}
    assert plan_memory_shares(plan_workers("disaggregated", 1, 1, "cpu"), CFG) == {}
    assert shared_devices(plan_workers("disaggregated", 1, 1, "cpu", ("cuda:0", "cuda:1"))) == set()
    assert device_key("cuda") == "cuda:0" and device_key("cpu") is None


def test_configured_weights_and_fixed_sizes():
    cfg = DistServeConfig.from_dict({"prefill": {"memory_share": 0.5}, "decode": {"memory_share": 0.5}})
    assert plan_memory_shares(plan_workers("disaggregated", 1, 1, "cuda"), cfg) == {"prefill-0": 0.45, "decode-1": 0.45}
    fixed = DistServeConfig.from_dict({"cache": {"num_gpu_blocks": 4000}})
    assert plan_memory_shares(plan_workers("disaggregated", 1, 1, "cuda"), fixed) == {}
    for bad in (0, -0.1, 1.5, "x"):
        with pytest.raises(Exception, match="decode.memory_share"):
            DistServeConfig.from_dict({"decode": {"memory_share": bad}})
    with pytest.raises(Exception, match="cache.gpu_memory_headroom_mb"):
        DistServeConfig.from_dict({"cache": {"gpu_memory_headroom_mb": -1}})


def test_shares_of_the_seed_form_leave_room_for_everything():
    """7B on one H200, 1P1D: each worker's KV fits inside its share with weights (12.6 GiB), its
    staging pool or receive buffers, CUDA graphs and headroom — and the two together stay inside
    0.9 of the device (the seed's default form took 87 + 24 GiB of KV and left 40 MiB free)."""
    block = 16 * 512 * 1024  # 7B: 0.5 MiB of KV per token, 16-token blocks
    shares = plan_memory_shares(plan_workers("disaggregated", 1, 1, "cuda"), CFG)
    peak, graphs = int(13.2 * GiB), 512 * MiB
    pf = kv_blocks_from_memory(
        H200,
        shares["prefill-0"],
        peak,
        200 * MiB,
        block,
        free_bytes=H200 - 1 * GiB,
        reserved_bytes=2 * GiB + graphs,
        headroom_bytes=1 * GiB,
        min_blocks=128,
    )
    # the decode worker starts after the prefill worker took its share: it sees less free
    free = H200 - 1 * GiB - pf.share_bytes
    dc = kv_blocks_from_memory(
        H200,
        shares["decode-1"],
        peak,
        200 * MiB,
        block,
        free_bytes=free,
        reserved_bytes=8192 * 512 * 1024 + graphs,
        headroom_bytes=1 * GiB,
        min_blocks=128,
    )
    for b in (pf, dc):
        used = b.peak_bytes + b.non_torch_bytes + b.kv_bytes + b.reserved_bytes
        assert used + b.headroom_bytes <= b.share_bytes
    assert pf.share_bytes + dc.share_bytes <= 0.9 * H200
    assert dc.kv_bytes > 3 * pf.kv_bytes > 0
    d = dc.to_dict()
    assert d["share_mib"] == dc.share_bytes // MiB and d["headroom_mib"] == 1024 and d["kv_blocks"] == dc.num_blocks


def test_reserved_memory_and_headroom_come_out_of_the_kv_cache():
    plain = kv_blocks_from_memory(80 * GiB, 0.5, 14 * GiB, 0, MiB)
    less = kv_blocks_from_memory(80 * GiB, 0.5, 14 * GiB, 0, MiB, reserved_bytes=2 * GiB, headroom_bytes=GiB)
    assert plain.num_blocks - less.num_blocks == 3 * 1024
    assert "reserved 2.00 GiB, headroom 1.00 GiB" in less.describe()


def test_a_share_that_cannot_hold_one_longest_sequence_refuses_in_one_sentence():
    # 1P2D of a 7B model on a 40 GiB device: the prefill share (~6.4 GiB) cannot even hold the weights
    with pytest.raises(MemoryBudgetError) as e:
        kv_blocks_from_memory(40 * GiB, 0.159, int(13.2 * GiB), 0, 8 * MiB, reserved_bytes=2 * GiB, min_blocks=128)
    msg = str(e.value)
    assert msg.count(". ") == 0 and "\n" not in msg
    assert "memory_share" in msg and "gpu_memory_utilization 0.159" in msg
    # enough for a few blocks, not for one sequence of the longest length: refused too
    with pytest.raises(MemoryBudgetError, match="need 1.00 GiB for one sequence"):
        kv_blocks_from_memory(16 * GiB, 0.5, 6 * GiB, 0, 8 * MiB, headroom_bytes=GiB + 512 * MiB, min_blocks=128)
    # the headroom is what tips it: without it the same share fits
    assert kv_blocks_from_memory(16 * GiB, 0.5, 6 * GiB, 0, 8 * MiB, min_blocks=128).num_blocks >= 128


def test_engine_config_carries_the_share_and_what_each_role_allocates_after_the_engine():
    pf = engine_config_for("prefill", CFG, "cuda:0", 0.27)
    dc = engine_config_for("decode", CFG, "cuda:0", 0.63)
    assert (pf.gpu_memory_utilization, dc.gpu_memory_utilization) == (0.27, 0.63)
    assert pf.gpu_memory_reserved_bytes == CFG.kv_transfer.cuda_ipc_pool_mb * MiB and dc.gpu_memory_reserved_bytes == 0
    assert dc.kv_receive_tokens == 2 * CFG.prefill.max_num_batched_tokens
    assert pf.kv_receive_tokens == CFG.prefill.max_seq_len  # one prompt's KV gathered out of its pool
    assert pf.gpu_memory_headroom_bytes == dc.gpu_memory_headroom_bytes == 1024 * MiB
    assert engine_config_for("colocated", CFG, "cuda").gpu_memory_utilization == 0.9  # by hand: the whole budget
    assert engine_config_for("prefill", CFG, "cpu").gpu_memory_reserved_bytes == 0


class _Proc:
    def __init__(self, pid):
        self.pid, self.returncode, self.args = pid, None, []

    def poll(self):
        return self.returncode

    def send_signal(self, sig):
        self.returncode = -sig

    def wait(self, timeout=None):
        return self.returncode

    def kill(self):
        self.returncode = -9


class _RecordingLauncher(Launcher):
    """The real start-up sequence; processes are recorded instead of spawned (no GPU here)."""

    def _spawn(self, argv, name, cpus=None, threads=None, extra_env=None):
        self.events.append(("spawn", name, list(argv)))
        if argv[0] == "router":
            ready = Path(argv[argv.index("--ready-file") + 1])
            ready.write_text(json.dumps({"url": "http://127.0.0.1:1"}))
        p = _Proc(1000 + len(self.events))
        self.procs.append(p)
        return p

    def wait_healthy(self, expected, deadline):
        self.events.append(("wait", expected))


@pytest.mark.parametrize("devices,staggered", [((), True), (("cuda:0", "cuda:1"), False)], ids=["one-gpu", "two-gpus"])
def test_launcher_hands_each_worker_its_share_and_staggers_a_shared_gpu(devices, staggered):
    la = _RecordingLauncher(CFG, "disaggregated", 1, 1, "t", pinning="none", device="cuda", devices=devices)
    la.events = []
    try:
        la.start()
    finally:
        la._tmp.cleanup()
    spawns = {e[1]: e[2] for e in la.events if e[0] == "spawn"}
    share = {w: float(a[a.index("--gpu-memory-utilization") + 1]) for w, a in spawns.items() if w != "router"}
    assert share == ({"prefill-0": 0.27, "decode-1": 0.63} if staggered else {"prefill-0": 0.9, "decode-1": 0.9})
    names = [e[1] if e[0] == "spawn" else e for e in la.events]
    if staggered:  # the decode worker starts once the prefill worker is up (sized and registered)
        assert names == ["router", "prefill-0", ("wait", 1), "decode-1", ("wait", 2)]
    else:
        assert names == ["router", "prefill-0", "decode-1", ("wait", 2)]
