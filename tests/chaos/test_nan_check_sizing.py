"""nan-check on real shapes: KV sized from the model's KV bytes per token for the lengths
asked, and lengths beyond the model's context reported as such, not as failures."""

from __future__ import annotations

import argparse
import json

import torch

from distserve.chaos import nan_check
from distserve.chaos.nan_check import beyond, check_backend, cli_main, failures, kv_blocks_for, lengths, model_context
from distserve.server.engine.model_runner import kv_bytes_per_block
from distserve.server.engine.presets import preset_config
from distserve.server.engine.tiny_model import make_tiny_model


def test_kv_for_the_7b_preset_holds_the_longest_prompt_asked():
    cfg = preset_config("preset:llama-2-7b")
    block = kv_bytes_per_block(cfg, 16, torch.bfloat16)
    assert block == 16 * 512 * 1024  # 0.5 MiB of KV per token
    for top in (2048, 4096):
        blocks = kv_blocks_for(top)
        assert blocks * 16 >= top + 2  # prompt + the token it decodes
        assert blocks * block < (top + 64) * 512 * 1024  # and not much more
    # the old sizing (max(64, top // 8) MiB) held 1024 tokens of this shape at top = 4096: "no step ran"
    assert (4096 // 8) * 2**20 // block * 16 < 4096
    assert model_context("preset:llama-2-7b") == 4096


def test_lengths_beyond_the_context_are_reported_not_failed(tmp_path):
    folder = make_tiny_model(tmp_path / "m", layers=1, hidden=64, heads=2, kv_heads=2, max_positions=40)
    assert model_context(str(folder)) == 40
    lens = lengths(66, 5)  # 31 32 33 63 64 65
    r = check_backend("sdpa", lens, str(folder), "cpu")
    assert r["lengths"] == {"31": "ok", "32": "ok", "33": "ok", **{str(n): "beyond context (40)" for n in (63, 64, 65)}}
    at_context = check_backend("sdpa", [40], str(folder), "cpu")  # fills the context: prefill checked alone
    assert at_context["lengths"] == {"40": "ok"}
    result = {"context": 40, "backends": {"sdpa": r}}
    assert failures(result) == [] and beyond(result) == [63, 64, 65]
    result["backends"]["sdpa"]["lengths"]["33"] = "NaN in prefill"
    assert failures(result) == ["sdpa @ 33: NaN in prefill"]


def test_cli_exit_0_and_says_which_lengths_were_beyond(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(nan_check, "CANDIDATES", ("sdpa",))  # the other backends' verdicts come the same way
    folder = make_tiny_model(tmp_path / "m", layers=1, hidden=64, heads=2, kv_heads=2, max_positions=40)
    args = argparse.Namespace(
        config=None, model=str(folder), max_len=66, min_k=5, device="cpu", json=str(tmp_path / "nan.json")
    )
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    assert "3 lengths beyond the model's context (40): 63..65" in out
    r = json.loads((tmp_path / "nan.json").read_text())
    assert r["failures"] == [] and r["backends"]["sdpa"]["lengths"]["64"] == "beyond context (40)"
