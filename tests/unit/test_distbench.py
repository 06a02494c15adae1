"""distbench's arithmetic: strategies, workloads, HDR statistics, SLO attainment, merge."""

from __future__ import annotations

import itertools
import json
import math
import random

import pytest

from distserve.distbench import result
from distserve.distbench.client import base_url
from distserve.distbench.datasets import Lengths, Vocab, jsonl_items, random_items
from distserve.distbench.metrics import decode, meets, merge_histograms, parse_goodput, parse_slo, pkey, summarize
from distserve.distbench.records import RequestRecord
from distserve.distbench.strategies import STRATEGIES, schedule


def _cv(times: list[float]) -> float:
    gaps = [y - x for x, y in itertools.pairwise(times)]
    mean = sum(gaps) / len(gaps)
    return (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5 / mean


def test_strategies_registered_by_name_fixed_in_advance_and_at_the_rate():
    assert {"closed", "poisson", "gamma", "constant"} <= set(STRATEGIES)
    a = schedule("poisson", 4000, 20.0, seed=3)
    assert a == schedule("poisson", 4000, 20.0, seed=3) and a == sorted(a)
    assert 4000 / a[-1] == pytest.approx(20.0, rel=0.05)
    bursty = schedule("gamma", 4000, 20.0, burstiness=0.2, seed=3)
    assert 4000 / bursty[-1] == pytest.approx(20.0, rel=0.15)
    assert _cv(bursty) > 1.5 * _cv(a)  # shape < 1 is burstier than Poisson (cv 1)
    assert schedule("constant", 5, 2.0) == [0.0, 0.5, 1.0, 1.5, 2.0]
    with pytest.raises(ValueError, match="closed"):
        schedule("closed", 3, 1.0)


def test_random_prompts_have_exact_lengths_inside_the_vocabulary():
    vocab = Vocab(300, frozenset({0, 1, 2, 299}))
    items = random_items(50, Lengths.parse("uniform:5:9", "p"), Lengths.parse("7", "o"), vocab, seed=1)
    assert items == random_items(50, Lengths.parse("uniform:5:9", "p"), Lengths.parse("7", "o"), vocab, seed=1)
    assert {len(i.prompt_ids) for i in items} == {5, 6, 7, 8, 9}
    assert all(i.prompt_len == len(i.prompt_ids) and i.output_len == 7 for i in items)
    assert all(0 <= t < 300 and t not in vocab.special for i in items for t in i.prompt_ids)


def test_prefix_sharing_and_multi_turn_sessions_carry_the_conversation():
    vocab = Vocab(512)
    items = random_items(6, Lengths.parse("10", "p"), Lengths.parse("4", "o"), vocab, prefix_len=32)
    assert all(i.prompt_ids[:32] == items[0].prompt_ids[:32] for i in items)
    assert len({tuple(i.prompt_ids[32:]) for i in items}) == 6
    turns = random_items(6, Lengths.parse("10", "p"), Lengths.parse("4", "o"), vocab, turns=3)
    assert [(i.session, i.turn) for i in turns] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    a, b = turns[0], turns[1]
    assert b.prompt_ids[: len(a.prompt_ids)] == a.prompt_ids and len(b.prompt_ids) == 10 + 4 + 10


def test_length_distributions_parse_and_reject():
    rng = random.Random(0)
    ln = [Lengths.parse("lognormal:100:0.5", "x").draw(rng) for _ in range(4000)]
    assert sorted(ln)[2000] == pytest.approx(100, rel=0.1)
    for bad in ("0", "uniform:9:3", "lognormal:x:1", "gauss:1:2"):
        with pytest.raises(ValueError, match="--prompt-len"):
            Lengths.parse(bad, "--prompt-len")


def test_jsonl_dataset_and_trace(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(
        "\n".join(
            json.dumps(d)
            for d in [
                {"timestamp": 10.5, "prompt_len": 8, "output_len": 3},
                {"timestamp": 10.0, "prompt": [5, 6], "output_len": 2},
                {"timestamp": 11.0, "prompt": "hello there", "output_len": 4},
            ]
        )
    )
    items = jsonl_items(str(p), None, Vocab(100), None)
    assert [i.at for i in items] == [0.0, 0.5, 1.0]
    assert items[0].prompt_ids == [5, 6] and len(items[1].prompt_ids) == 8 and items[2].text == "hello there"
    assert [i.output_len for i in items] == [2, 3, 4]
    # --output-len replaces each line's own length (a prefill-bound probe over a dataset's prompt lengths)
    assert [i.output_len for i in jsonl_items(str(p), None, Vocab(100), Lengths.parse("2", "--output-len"))] == [2] * 3
    vllm_custom = tmp_path / "custom.jsonl"  # vLLM's custom dataset format drives distbench too
    vllm_custom.write_text('{"prompt": "What is the capital of India?", "output_tokens": 10}\n')
    [item] = jsonl_items(str(vllm_custom), None, None, None)
    assert item.text.startswith("What") and item.output_len == 10 and item.at is None
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": [1], "output_len": 0}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        jsonl_items(str(bad), None, None, None)


def test_url_with_or_without_v1():
    assert base_url("http://h:1/v1/") == base_url("http://h:1/v1") == base_url("http://h:1/") == "http://h:1"


def _records(n: int = 500, seed: int = 0, failed_every: int = 0) -> list[RequestRecord]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        sched = i * 0.05
        late = rng.choice([0.0, 0.0, 0.0004, 0.02])
        ttft = rng.lognormvariate(math.log(0.08), 0.6) + late
        tp = rng.uniform(0.01, 0.06)
        r = RequestRecord(
            i,
            sched,
            sched + late,
            1000.0 + sched,
            ttft=ttft,
            ttft_service=ttft - late,
            e2e=ttft + 15 * tp,
            itl=[tp] * 15,
            prompt_tokens=128,
            output_tokens=16,
        )
        if failed_every and i % failed_every == 0:
            r = RequestRecord(i, sched, sched, 1000.0 + sched, prompt_tokens=128, error="HTTP 503: overloaded")
        out.append(r)
    return out


def nearest_rank(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


def test_result_percentiles_agree_with_an_independent_computation_from_the_records():
    recs = _records(failed_every=25)
    s = summarize(recs, 30.0, (50, 90, 99, 99.9), parse_slo("ttft:250ms,tpot:50ms"))
    ok = [r for r in recs if r.ok]
    for key, vals in {
        "ttft": [r.ttft for r in ok],
        "tpot": [r.tpot for r in ok],
        "itl": [x for r in ok for x in r.itl],
        "e2el": [r.e2e for r in ok],
        "ttft_service": [r.ttft_service for r in ok],
    }.items():
        for q in (50, 90, 99, 99.9):
            want = nearest_rank(vals, q) * 1000
            assert s[f"{pkey(q)}_{key}_ms"] == pytest.approx(want, rel=1e-3, abs=1e-3), (key, q)
        assert s[f"mean_{key}_ms"] == pytest.approx(1000 * sum(vals) / len(vals), rel=1e-3)
    assert s["p99.9_ttft_ms"] >= s["p99_ttft_ms"] and "median_ttft_ms" in s
    assert s["completed"] == len(ok) and s["failed"] == 20
    assert s["failures"] == {"HTTP 503: overloaded": 20}
    met = sum(1 for r in ok if r.ttft <= 0.25 and r.tpot <= 0.05)
    assert s["slo_attainment"] == pytest.approx(met / 500)  # failed requests count as misses
    assert s["late_sends"] == sum(1 for r in recs if r.late > 0.001)
    assert s["request_goodput"] == pytest.approx(met / 30.0)


def test_slo_and_goodput_parsing():
    assert parse_slo("ttft:250ms,tpot:0.05s,e2e:2s") == {"ttft": 0.25, "tpot": 0.05, "e2el": 2.0}
    assert parse_goodput(["ttft:250", "tpot:50"]) == {"ttft": 0.25, "tpot": 0.05}
    for bad in ("latency:3ms", "ttft:fast", "ttft:-1ms"):
        with pytest.raises(ValueError, match="--slo"):
            parse_slo(bad)
    failed = RequestRecord(0, 0.0, error="HTTP 503")
    assert not meets(failed, {}) and not meets(failed, {"ttft": 10.0})


def test_warmup_requests_are_excluded_from_every_figure():
    recs = _records(50)
    warm = RequestRecord(-1, 0.0, ttft=9.0, ttft_service=9.0, e2e=9.5, output_tokens=4, warmup=True)
    a = summarize(recs, 10.0, (99,))
    b = summarize([warm, *recs], 10.0, (99,))
    assert a["p99_ttft_ms"] == b["p99_ttft_ms"] and a["num_prompts"] == b["num_prompts"] == 50


def test_merge_is_lossless():
    a, b = _records(300, seed=1), _records(200, seed=2)
    sa, sb, sab = summarize(a, 10, (99,)), summarize(b, 10, (99,)), summarize(a + b, 10, (99,))
    merged = merge_histograms([sa["histograms"], sb["histograms"]])
    for name in ("ttft", "itl", "e2el", "send_lag"):
        assert merged[name].get_total_count() == decode(sab["histograms"][name]).get_total_count()
        for q in (50, 99, 99.9):
            assert merged[name].get_value_at_percentile(q) == decode(sab["histograms"][name]).get_value_at_percentile(q)


def test_result_file_round_trips_records(tmp_path):
    recs = _records(20)
    res = result.build(recs, 2.0, 1000.0, {"strategy": "poisson", "request_rate": 10}, (50, 99), {}, {})
    p = result.save(res, tmp_path / "r.json")
    back = result.records_of(result.load(p))
    assert [r.to_dict() for r in back] == [r.to_dict() for r in recs]
    assert {
        "request_throughput",
        "output_throughput",
        "mean_ttft_ms",
        "median_tpot_ms",
        "std_itl_ms",
        "p99_e2el_ms",
        "request_goodput",
        "ttfts",
        "itls",
        "requests",
        "config",
        "environment",
    } <= set(res)
    for key in (
        "index",
        "scheduled",
        "sent",
        "start_unix",
        "ttft",
        "ttft_service",
        "e2e",
        "itl",
        "tpot",
        "prompt_tokens",
        "output_tokens",
        "error",
    ):
        assert key in res["requests"][0]
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(ValueError, match="not a distbench result"):
        result.load(tmp_path / "x.json")


def test_sharegpt_from_a_path_uses_the_first_exchange(tmp_path):
    from distserve.distbench.datasets import sharegpt_items

    convs = [
        {"conversations": [{"from": "human", "value": "q" * 40 * (i + 1)}, {"from": "gpt", "value": "a" * 80}]}
        for i in range(5)
    ] + [{"conversations": [{"from": "human", "value": "lonely"}]}]
    p = tmp_path / "sg.json"
    p.write_text(json.dumps(convs))
    items = sharegpt_items(10, str(p), None, None, seed=1)
    assert len(items) == 5 and all(i.output_len == 20 and i.text.startswith("q") for i in items)
    assert sorted(i.prompt_len for i in items) == [10, 20, 30, 40, 50]
    cut = tmp_path / "cut.json"  # the PyPI package's copy ends mid-string: the complete ones are used
    text = json.dumps(convs[:3], indent=1)
    cut.write_text(text[: text.rindex('"value"') + 12])
    assert len(sharegpt_items(10, str(cut), None, None)) == 2
