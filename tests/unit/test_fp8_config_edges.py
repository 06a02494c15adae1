"""Precision and calibration keys at the edges: each invalid value or combination is one ConfigError sentence
(``distserve serve`` exits 2 with it), never an exception from inside the validation."""

from __future__ import annotations

import subprocess
import sys

import pytest

from distserve.server.config import ConfigError, load_config

HUGE = 10**400  # what YAML makes of 400 digits


@pytest.mark.parametrize(
    ("over", "words"),
    [
        ({"cache": {"kv_calibration_requests": HUGE}}, "'cache.kv_calibration_requests' must be in [0, 100000000]"),
        ({"cache": {"kv_scale_init": HUGE}}, "'cache.kv_scale_init' must be a finite number"),
        ({"cache": {"kv_scale_init": -HUGE}}, "'cache.kv_scale_init' must be a finite number"),
        # 0 in float32 (x / 0: NaN and inf bytes), or a scale under which every value saturates
        ({"cache": {"kv_scale_init": 1e-300}}, "'cache.kv_scale_init' must be in [1e-08, 1000000]"),
        ({"cache": {"kv_scale_init": 1e-9}}, "'cache.kv_scale_init' must be in [1e-08, 1000000]"),
        # 'on' promises by reference or a failed request; an FP8 cache is never shared, so it silently copied
        (
            {"cache": {"kv_dtype": "fp8_e4m3"}, "kv_transfer": {"by_reference": "on"}},
            "'kv_transfer.by_reference' on needs a KV cache in the compute dtype on both roles, got cache.kv_dtype",
        ),
        (
            {"prefill": {"kv_dtype": "fp8_e4m3"}, "kv_transfer": {"by_reference": "on"}},
            "got prefill.kv_dtype fp8_e4m3",
        ),
    ],
)
def test_edge_values_are_one_config_error(over, words):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=over)
    assert words in str(info.value) and "\n" not in str(info.value)
    assert len(str(info.value)) < 400  # the 400 digits are not echoed


def test_edge_values_that_are_valid():
    c = load_config(overrides={"cache": {"kv_dtype": "fp8_e4m3", "kv_calibration_requests": 0, "kv_scale_init": 1e-8}})
    assert (c.cache.kv_calibration_requests, c.cache.kv_scale_init) == (0, 1e-8)
    c = load_config(overrides={"cache": {"kv_dtype": "fp8_e4m3", "kv_calibration_requests": 100_000_000}})
    assert c.cache.kv_calibration_requests == 100_000_000
    # auto: by reference when it can (never with an FP8 cache), else the copy path
    assert load_config(overrides={"cache": {"kv_dtype": "fp8_e4m3"}, "kv_transfer": {"by_reference": "auto"}})


def test_a_400_digit_calibration_count_exits_2_with_one_sentence(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"cache:\n  kv_dtype: fp8_e4m3\n  kv_calibration_requests: {HUGE}\n")
    r = subprocess.run(
        [sys.executable, "-m", "distserve.server.cli", "serve", "--config", str(cfg), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert len(r.stderr.strip().splitlines()) == 1 and "kv_calibration_requests" in r.stderr, r.stderr


@pytest.mark.parametrize(
    ("key", "text", "hint"),
    [("kv_scale_init", "1e-3", "write 1.0e-3"), ("kv_calibration_requests", "1e3", "write 1000")],
)
def test_a_yaml_e_notation_string_says_how_to_write_the_number(tmp_path, key, text, hint):
    """PyYAML (YAML 1.1) reads ``1e-3`` as the string '1e-3': the sentence says so instead of only 'got str'."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"cache:\n  {key}: {text}\n")
    with pytest.raises(ConfigError, match="must be") as info:
        load_config(cfg)
    assert hint in str(info.value), str(info.value)
