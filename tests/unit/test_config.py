"""Typed configuration: defaults, YAML file, validation messages, overrides."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest
import yaml

from distserve.server.config import (
    BreakerConfig,
    CacheConfig,
    ConfigError,
    DecodeConfig,
    DistServeConfig,
    KVTransferConfig,
    PrefillConfig,
    RouterConfig,
    load_config,
)

REPO = Path(__file__).resolve().parents[2]
YAML_PATH = REPO / "configs" / "distserve_config.yaml"


def _err(overrides: dict) -> str:
    with pytest.raises(ConfigError) as ei:
        load_config(overrides=overrides)
    return str(ei.value)


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "cfg.yaml"
    p.write_text(text)
    return p


# ------------------------------------------------------------------ defaults


def test_defaults_match_spec():
    c = load_config()
    assert c == DistServeConfig()
    assert c.model is None
    assert (c.prefill.max_batch_size, c.prefill.max_seq_len) == (32, 2048)
    assert c.prefill.attention_backend == "auto"
    assert c.prefill.max_num_batched_tokens == 4096
    assert c.prefill.torch_threads == 0
    assert (c.decode.max_batch_size, c.decode.max_concurrent_requests) == (128, 256)
    assert (c.router.sampling_strategy, c.router.top_p) == ("top_p", 0.95)
    assert (c.decode.gc_interval_ms, c.decode.max_stale_slots, c.decode.torch_threads) == (500, 16, 0)
    assert c.cache == CacheConfig(block_size=16, num_gpu_blocks=0, kv_cache_memory_mb=512, dtype="auto")
    kv = c.kv_transfer
    assert (kv.transport, kv.zero_copy_threshold_mb, kv.lease_ms) == ("auto", 16.0, 30000)
    assert (kv.failure_policy, kv.pull_timeout_ms, kv.checksum) == ("recompute", 10000, True)
    r = c.router
    assert (r.host, r.port, r.backup_pool) == ("127.0.0.1", 8080, ())
    assert (r.heartbeat_interval_ms, r.heartbeat_timeout_ms, r.request_timeout_s) == (1000, 3000, 600.0)
    assert r.admin_token is None
    b = r.breaker
    assert (b.enabled, b.metric, b.percentile, b.threshold_ms) == (False, "ttft", 99.0, 300.0)
    assert (b.consecutive_s, b.cooldown_s, b.probe_fraction, b.min_samples) == (5.0, 30.0, 0.1, 20)


def test_section_types():
    c = load_config()
    assert isinstance(c.prefill, PrefillConfig)
    assert isinstance(c.decode, DecodeConfig)
    assert isinstance(c.cache, CacheConfig)
    assert isinstance(c.kv_transfer, KVTransferConfig)
    assert isinstance(c.router, RouterConfig)
    assert isinstance(c.router.breaker, BreakerConfig)
    assert issubclass(ConfigError, ValueError)


def test_yaml_file_equals_defaults():
    assert load_config(YAML_PATH) == load_config()
    assert load_config(str(YAML_PATH)) == DistServeConfig()


def test_yaml_file_lists_every_key():
    # The shipped file documents every key, not just a subset that happens to match defaults.
    raw = yaml.safe_load(YAML_PATH.read_text())
    assert raw == DistServeConfig().to_dict()


def test_missing_keys_take_defaults(tmp_path):
    p = _write(tmp_path, "decode:\n  top_p: 0.5\nrouter:\n  breaker:\n    enabled: true\n")
    c = load_config(p)
    assert c.router.top_p == 0.5
    assert c.router.breaker.enabled is True
    assert c.decode.max_batch_size == 128
    assert c.router.breaker.metric == "ttft"
    assert c.prefill == PrefillConfig()


def test_empty_file_and_empty_section_are_defaults(tmp_path):
    assert load_config(_write(tmp_path, "")) == DistServeConfig()
    assert load_config(_write(tmp_path, "prefill:\nrouter:\n  breaker:\n")) == DistServeConfig()


# ---------------------------------------------------------------- round trip


def test_round_trip():
    c = load_config(
        overrides={
            "model": "/models/llama",
            "cache": {"block_size": 32, "dtype": "bfloat16"},
            "router": {
                "top_p": 0.8,
                "sampling_strategy": "greedy",
                "backup_pool": ["http://a:1", "https://b"],
                "admin_token": "s3cret",
                "breaker": {"enabled": True, "metric": "itl", "min_samples": 5},
            },
        }
    )
    d = c.to_dict()
    assert isinstance(d["router"]["backup_pool"], list)
    assert isinstance(d["router"]["breaker"], dict)
    assert DistServeConfig.from_dict(d) == c
    # ...and through YAML text, the way a dumped config would be reloaded.
    assert DistServeConfig.from_dict(yaml.safe_load(yaml.safe_dump(d))) == c
    assert c.router.backup_pool == ("http://a:1", "https://b")
    assert c.router.breaker.metric == "itl"


def test_from_dict_partial():
    c = DistServeConfig.from_dict({"prefill": {"max_seq_len": 4096}})
    assert c.prefill.max_seq_len == 4096
    assert c.decode == DecodeConfig()


# --------------------------------------------------------------- unknown keys


def test_unknown_key_top_level():
    msg = _err({"modle": "x"})
    assert msg == "unknown key 'modle'; did you mean 'model'?"


def test_unknown_key_in_section():
    msg = _err({"decode": {"max_batch_sise": 4}})
    assert msg == "unknown key 'decode.max_batch_sise'; did you mean 'decode.max_batch_size'?"


def test_unknown_key_in_breaker():
    msg = _err({"router": {"breaker": {"treshold_ms": 10}}})
    assert msg == "unknown key 'router.breaker.treshold_ms'; did you mean 'router.breaker.threshold_ms'?"


def test_unknown_key_without_close_match_lists_valid_keys():
    msg = _err({"cache": {"zzzzzz": 1}})
    assert msg.startswith("unknown key 'cache.zzzzzz'; ")
    for k in ("block_size", "num_gpu_blocks", "kv_cache_memory_mb", "dtype"):
        assert k in msg


def test_unknown_section():
    assert _err({"prefil": {}}) == "unknown key 'prefil'; did you mean 'prefill'?"


def test_unknown_key_in_file_names_file(tmp_path):
    p = _write(tmp_path, "kv_transfer:\n  leese_ms: 5\n")
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    assert str(p) in str(ei.value)
    assert "unknown key 'kv_transfer.leese_ms'; did you mean 'kv_transfer.lease_ms'?" in str(ei.value)


def test_from_dict_rejects_unknown_key():
    with pytest.raises(ConfigError, match=re.escape("'router.porrt'; did you mean 'router.port'?")):
        DistServeConfig.from_dict({"router": {"porrt": 1}})


# ---------------------------------------------------------------- wrong types


def test_str_for_int():
    assert _err({"prefill": {"max_batch_size": "abc"}}) == (
        "'prefill.max_batch_size' must be an integer, got str 'abc'"
    )


def test_bool_for_int_rejected():
    msg = _err({"prefill": {"max_batch_size": True}})
    assert msg == "'prefill.max_batch_size' must be an integer, got bool True"


def test_float_for_int_rejected():
    msg = _err({"cache": {"block_size": 16.0}})
    assert msg == "'cache.block_size' must be an integer, got float 16.0"


def test_int_accepted_for_float():
    c = load_config(overrides={"router": {"top_p": 1, "request_timeout_s": 5}})
    assert c.router.top_p == 1.0 and isinstance(c.router.top_p, float)
    assert isinstance(c.router.request_timeout_s, float)


def test_bool_for_float_rejected():
    assert "'router.breaker.percentile' must be a number, got bool False" == _err(
        {"router": {"breaker": {"percentile": False}}}
    )


def test_str_for_bool_rejected():
    msg = _err({"kv_transfer": {"checksum": "yes"}})
    assert msg.startswith("'kv_transfer.checksum' must be a boolean")
    assert "got str 'yes'" in msg


def test_null_for_int_rejected():
    msg = _err({"decode": {"max_stale_slots": None}})
    assert msg == "'decode.max_stale_slots' must be an integer, got null"


def test_backup_pool_must_be_list_of_str():
    assert _err({"router": {"backup_pool": "http://a:1"}}).startswith(
        "'router.backup_pool' must be a list of strings, got str"
    )
    assert "must be a list of strings" in _err({"router": {"backup_pool": ["http://a:1", 5]}})
    assert "'router.backup_pool[0]' must be an http(s) URL" in _err({"router": {"backup_pool": ["a:1"]}})


def test_optional_strings():
    assert load_config(overrides={"router": {"admin_token": "t"}}).router.admin_token == "t"
    assert "'router.admin_token' must be a string or null, got int 5" == _err({"router": {"admin_token": 5}})
    assert "'model' must be a string or null" in _err({"model": 1})
    assert "'router.host' must be a string, got null" == _err({"router": {"host": None}})


def test_section_not_a_mapping():
    msg = _err({"prefill": [1, 2]})
    assert "'prefill'" in msg and "mapping" in msg
    msg = _err({"router": {"breaker": 5}})
    assert "'router.breaker'" in msg and "mapping" in msg


def test_top_level_not_a_mapping(tmp_path):
    p = _write(tmp_path, "- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping") as ei:
        load_config(p)
    assert str(p) in str(ei.value)


# --------------------------------------------------------------- out of range


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"router": {"top_p": 1.5}}, "'router.top_p' must be in (0, 1], got 1.5"),
        ({"router": {"top_p": 0}}, "'router.top_p' must be in (0, 1], got 0"),
        ({"prefill": {"max_batch_size": 0}}, "'prefill.max_batch_size' must be in [1, 4096], got 0"),
        ({"prefill": {"max_batch_size": 4097}}, "'prefill.max_batch_size' must be in [1, 4096], got 4097"),
        ({"prefill": {"max_seq_len": 8}}, "'prefill.max_seq_len' must be in [16, 1048576], got 8"),
        ({"prefill": {"torch_threads": -1}}, "'prefill.torch_threads' must be in [0, 1024], got -1"),
        ({"decode": {"gc_interval_ms": 0}}, "'decode.gc_interval_ms' must be in [1, 3600000], got 0"),
        ({"decode": {"max_stale_slots": -1}}, "'decode.max_stale_slots' must be in [0, 1000000], got -1"),
        ({"cache": {"block_size": 24}}, "'cache.block_size' must be a power of two in [1, 256], got 24"),
        ({"cache": {"block_size": 512}}, "'cache.block_size' must be a power of two in [1, 256], got 512"),
        ({"cache": {"num_gpu_blocks": -1}}, "'cache.num_gpu_blocks' must be in [0, 10000000], got -1"),
        ({"cache": {"kv_cache_memory_mb": 0}}, "'cache.kv_cache_memory_mb' must be in [1, 10000000], got 0"),
        (
            {"kv_transfer": {"zero_copy_threshold_mb": -0.5}},
            "'kv_transfer.zero_copy_threshold_mb' must be >= 0, got -0.5",
        ),
        ({"kv_transfer": {"lease_ms": 0}}, "'kv_transfer.lease_ms' must be in [1, 3600000], got 0"),
        ({"router": {"port": 65536}}, "'router.port' must be in [0, 65535], got 65536"),
        ({"router": {"request_timeout_s": 0}}, "'router.request_timeout_s' must be > 0, got 0"),
        ({"router": {"breaker": {"percentile": 100}}}, "'router.breaker.percentile' must be in (0, 100), got 100"),
        ({"router": {"breaker": {"percentile": 0}}}, "'router.breaker.percentile' must be in (0, 100), got 0"),
        ({"router": {"breaker": {"threshold_ms": 0}}}, "'router.breaker.threshold_ms' must be > 0, got 0"),
        (
            {"router": {"breaker": {"probe_fraction": 1.01}}},
            "'router.breaker.probe_fraction' must be in (0, 1], got 1.01",
        ),
        ({"router": {"breaker": {"min_samples": 0}}}, "'router.breaker.min_samples' must be in [1, 10000000], got 0"),
    ],
)
def test_out_of_range(overrides, message):
    assert _err(overrides) == message


def test_nan_rejected():
    assert "'router.top_p' must be in (0, 1], got nan" == _err({"router": {"top_p": math.nan}})


@pytest.mark.parametrize(
    "overrides",
    [
        {"router": {"top_p": 1.0}},
        {"prefill": {"max_batch_size": 1, "max_seq_len": 16, "torch_threads": 1024}},
        {"cache": {"block_size": 1, "num_gpu_blocks": 10_000_000}},
        {"cache": {"block_size": 256}},
        {"router": {"port": 0}},
        {"router": {"port": 65535}},
        {"kv_transfer": {"zero_copy_threshold_mb": 0}},
        {"router": {"breaker": {"probe_fraction": 1, "percentile": 99.9, "min_samples": 1}}},
    ],
)
def test_boundaries_accepted(overrides):
    load_config(overrides=overrides)


# ---------------------------------------------------------------------- enums


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"prefill": {"attention_backend": "flash"}},
            "'prefill.attention_backend' must be one of auto, sdpa, cpu_paged, flash_attn_v2, triton; got 'flash'",
        ),
        (
            {"router": {"sampling_strategy": "beam"}},
            "'router.sampling_strategy' must be one of greedy, top_p; got 'beam'",
        ),
        ({"cache": {"dtype": "fp16"}}, "'cache.dtype' must be one of auto, float32, float16, bfloat16; got 'fp16'"),
        (
            {"kv_transfer": {"transport": "rdma"}},
            "'kv_transfer.transport' must be one of auto, shm, cuda_ipc, tcp, nixl; got 'rdma'",
        ),
        (
            {"kv_transfer": {"failure_policy": "retry"}},
            "'kv_transfer.failure_policy' must be one of recompute, fail; got 'retry'",
        ),
        (
            {"router": {"breaker": {"metric": "p99"}}},
            "'router.breaker.metric' must be one of ttft, tpot, itl, e2e; got 'p99'",
        ),
        ({"cache": {"dtype": 16}}, "'cache.dtype' must be one of auto, float32, float16, bfloat16; got 16"),
    ],
)
def test_enum_errors(overrides, message):
    assert _err(overrides) == message


def test_every_enum_value_accepted():
    for backend in ("auto", "sdpa", "cpu_paged", "flash_attn_v2", "triton"):
        assert load_config(overrides={"prefill": {"attention_backend": backend}}).prefill.attention_backend == backend
    for t in ("auto", "shm", "cuda_ipc", "tcp", "nixl"):
        assert load_config(overrides={"kv_transfer": {"transport": t}}).kv_transfer.transport == t


# ------------------------------------------------------------------ overrides


def test_overrides_merge_on_file(tmp_path):
    p = _write(
        tmp_path,
        "model: /m\ndecode:\n  top_p: 0.5\n  max_batch_size: 7\nrouter:\n  port: 9000\n  breaker:\n    enabled: true\n",
    )
    c = load_config(p, overrides={"decode": {"top_p": 0.7}, "router": {"breaker": {"metric": "e2e"}}})
    assert c.router.top_p == 0.7  # overridden (decode.top_p in both: moved to router.top_p, config_moves.py)
    assert c.decode.max_batch_size == 7  # kept from the file (same section)
    assert c.router.port == 9000  # kept from the file
    assert c.router.breaker.enabled is True  # kept from the file (nested section)
    assert c.router.breaker.metric == "e2e"  # overridden
    assert c.model == "/m"
    assert c.cache == CacheConfig()  # defaults elsewhere


def test_overrides_without_file():
    c = load_config(overrides={"model": "/x", "prefill": {"torch_threads": 4}})
    assert c.model == "/x" and c.prefill.torch_threads == 4
    assert c.prefill.max_batch_size == 32


def test_override_can_reset_model_to_null(tmp_path):
    p = _write(tmp_path, "model: /m\n")
    assert load_config(p, overrides={"model": None}).model is None


def test_overrides_are_validated():
    assert "unknown key 'router.topp'; did you mean 'router.top_p'?" == _err({"router": {"topp": 0.1}})
    assert _err({"router": {"port": "80"}}) == "'router.port' must be an integer, got str '80'"


def test_overrides_do_not_mutate_input():
    o = {"decode": {"top_p": 0.3}}
    load_config(YAML_PATH, overrides=o)
    assert o == {"decode": {"top_p": 0.3}}


# --------------------------------------------------------------------- errors


def test_yaml_parse_error_names_file_and_line(tmp_path):
    p = _write(tmp_path, "prefill:\n  max_batch_size: 4\n  bad: [1, 2\n")
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    msg = str(ei.value)
    assert str(p) in msg
    m = re.search(re.escape(str(p)) + r":(\d+)", msg)
    assert m and int(m.group(1)) in (3, 4), msg


def test_yaml_parse_error_line_for_bad_indent(tmp_path):
    p = _write(tmp_path, "decode:\n  top_p: 0.5\n max_batch_size: 3\n")
    with pytest.raises(ConfigError, match=re.escape(f"{p}:3")):
        load_config(p)


def test_missing_file(tmp_path):
    p = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=re.escape(str(p))):
        load_config(p)


def test_value_error_in_file_names_file(tmp_path):
    p = _write(tmp_path, "decode:\n  top_p: 2\n")
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    assert str(p) in str(ei.value) and "'router.top_p' must be in (0, 1], got 2" in str(ei.value)


def test_direct_construction_validates():
    with pytest.raises(ConfigError, match=re.escape("'router.top_p' must be in (0, 1], got 0")):
        RouterConfig(top_p=0)
    with pytest.raises(ConfigError, match=re.escape("'router.breaker.cooldown_s' must be > 0")):
        RouterConfig(breaker=BreakerConfig(cooldown_s=-1))


# --------------------------------------------------------------------- frozen


def test_frozen():
    c = load_config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.model = "x"
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.router.top_p = 0.5
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.router.breaker.enabled = True
    assert isinstance(c.router.backup_pool, tuple)  # no mutable list inside a frozen config
    assert hash(c) == hash(load_config())


def test_replace_revalidates():
    c = load_config()
    assert dataclasses.replace(c.router, top_p=0.5).top_p == 0.5
    with pytest.raises(ConfigError):
        dataclasses.replace(c.router, top_p=2.0)


def test_each_role_reads_its_own_section():
    from distserve.server.workers.worker import engine_config_for

    cfg = load_config(
        overrides={
            "prefill": {"attention_backend": "sdpa", "max_batch_size": 3, "max_seq_len": 512},
            "decode": {"attention_backend": "cpu_paged", "max_batch_size": 7, "max_concurrent_requests": 5},
        }
    )
    pf, dc, co = (engine_config_for(r, cfg, "cpu") for r in ("prefill", "decode", "colocated"))
    assert (pf.attention_backend, pf.max_num_seqs, pf.prefill_policy) == ("sdpa", 3, "wfs")
    assert (dc.attention_backend, dc.max_num_seqs, dc.decode_policy) == ("cpu_paged", 5, "fewest_remaining")
    assert (co.attention_backend, co.max_num_seqs) == ("cpu_paged", 7)
    assert pf.max_model_len == dc.max_model_len == co.max_model_len == 512  # the serving limit is shared
