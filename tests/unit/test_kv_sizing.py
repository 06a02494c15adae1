"""KV sizing from device memory: the arithmetic (kv_sizing) and the config key; the CUDA
measuring path runs in tests/gpu."""

import pytest

from distserve.server.config import DistServeConfig
from distserve.server.engine.kv_sizing import kv_blocks_from_memory

GiB = 2**30


def test_blocks_get_what_weights_and_activations_leave():
    # 140 GiB device, 0.9 -> 126 GiB; 14 GiB weights+activations, 1 GiB outside torch -> 111 GiB of KV
    b = kv_blocks_from_memory(140 * GiB, 0.9, 14 * GiB, 1 * GiB, 8 * 2**20)
    assert b.num_blocks == 111 * GiB // (8 * 2**20)
    assert b.kv_bytes <= 0.9 * 140 * GiB - 15 * GiB
    assert "gpu_memory_utilization 0.90" in b.describe()


def test_lower_utilization_gives_fewer_blocks():
    hi = kv_blocks_from_memory(80 * GiB, 0.9, 14 * GiB, 0, 2**20).num_blocks
    lo = kv_blocks_from_memory(80 * GiB, 0.5, 14 * GiB, 0, 2**20).num_blocks
    assert 0 < lo < hi


def test_no_room_names_the_knobs():
    with pytest.raises(ValueError, match="gpu_memory_utilization.*max_num_batched_tokens.*num_gpu_blocks"):
        kv_blocks_from_memory(16 * GiB, 0.5, 8 * GiB, 0, 2**20)


@pytest.mark.parametrize("u", [0.0, -0.1, 1.5])
def test_utilization_out_of_range(u):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_blocks_from_memory(16 * GiB, u, 0, 0, 2**20)


def test_config_key_validated():
    assert DistServeConfig.from_dict({}).cache.gpu_memory_utilization == 0.9
    assert DistServeConfig.from_dict({"cache": {"gpu_memory_utilization": 0.5}}).cache.gpu_memory_utilization == 0.5
    assert DistServeConfig.from_dict({"cache": {"gpu_memory_utilization": 0}}).cache.gpu_memory_utilization == 0
    for bad in (-0.1, 1.2, "x"):
        with pytest.raises(Exception, match="gpu_memory_utilization"):
            DistServeConfig.from_dict({"cache": {"gpu_memory_utilization": bad}})


def test_capped_by_what_is_free():
    # another process holds most of the device: this worker's share is not all free
    share = kv_blocks_from_memory(140 * GiB, 0.45, 14 * GiB, 0, 2**20).num_blocks
    capped = kv_blocks_from_memory(140 * GiB, 0.45, 14 * GiB, 0, 2**20, free_bytes=20 * GiB)
    assert capped.num_blocks == (20 * GiB - 256 * 2**20) // 2**20 < share
