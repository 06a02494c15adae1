"""Keys that moved to the section of the role that reads them (``server/config_moves.py``): the old spelling
loads into the new key with one warning naming it; both spellings with different values are refused."""

from __future__ import annotations

import logging

import pytest

from distserve.server.config import ConfigError, DecodeConfig, load_config
from distserve.server.config_moves import MOVED, apply_moves
from distserve.server.router.protocol import CompletionRequest
from distserve.server.router.sampling_defaults import default_sampling


def test_the_old_keys_load_into_the_router_with_one_warning_each_naming_the_new_one(tmp_path, caplog):
    p = tmp_path / "c.yaml"
    p.write_text("decode:\n  sampling_strategy: greedy\n  top_p: 0.5\n  max_batch_size: 7\n")
    with caplog.at_level(logging.WARNING, logger="distserve.server.config"):
        c = load_config(p)
    assert (c.router.sampling_strategy, c.router.top_p, c.decode.max_batch_size) == ("greedy", 0.5, 7)
    moved = [r.getMessage() for r in caplog.records if "is read by the router" in r.getMessage()]
    assert moved == [
        f"{p}: decode.sampling_strategy is read by the router: write it as router.sampling_strategy",
        f"{p}: decode.top_p is read by the router: write it as router.top_p",
    ]
    # what the router does with it: an omitted temperature is greedy
    assert default_sampling(CompletionRequest(prompt="x"), c.router) == (0.0, 1.0)
    assert not hasattr(DecodeConfig(), "top_p")  # one home: the decode section no longer has them


def test_the_new_keys_load_without_a_warning_and_the_old_ones_work_as_overrides(tmp_path, caplog):
    p = tmp_path / "c.yaml"
    p.write_text("router:\n  top_p: 0.6\n")
    with caplog.at_level(logging.WARNING, logger="distserve.server.config"):
        assert load_config(p).router.top_p == 0.6
        assert not caplog.records
        c = load_config(p, overrides={"decode": {"top_p": 0.7}})
    assert c.router.top_p == 0.7
    assert [r.getMessage() for r in caplog.records] == [
        "overrides: decode.top_p is read by the router: write it as router.top_p"
    ]


def test_both_spellings_that_differ_are_refused_and_the_same_value_twice_is_fine(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("decode:\n  top_p: 0.5\nrouter:\n  top_p: 0.9\n")
    with pytest.raises(ConfigError, match="decode.top_p and router.top_p are both given and differ"):
        load_config(p)
    p.write_text("decode:\n  top_p: 0.9\nrouter:\n  top_p: 0.9\n")
    assert load_config(p).router.top_p == 0.9


def test_apply_moves_copies_and_leaves_other_input_alone():
    raw = {"decode": {"top_p": 0.3, "max_batch_size": 2}}
    out, warnings = apply_moves(raw)
    assert raw == {"decode": {"top_p": 0.3, "max_batch_size": 2}}  # not mutated
    assert out == {"decode": {"max_batch_size": 2}, "router": {"top_p": 0.3}} and len(warnings) == 1
    assert apply_moves({"decode": {"max_batch_size": 2}}) == ({"decode": {"max_batch_size": 2}}, [])
    assert apply_moves(None) == (None, [])
    assert set(MOVED.values()) == {("router", "sampling_strategy"), ("router", "top_p")}
