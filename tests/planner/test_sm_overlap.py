"""Overlapping MPS shares (issue 31): a 1P1D split of one GPU whose caps sum above 100 % (``--sm-split 100:50``).

The model (docs/PLANNER.md): while both workers are in a step the SMs divide in proportion to the caps
(``contended_share``), for the part of the other's step its GPU work fills; otherwise each has its own cap. The
search proposes overlapping splits (``--sm-splits auto`` and lists) and never a share whose bf16 GEMMs the profile
recorded wrong."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from distserve.planner.cli import _inputs
from distserve.planner.latency import LatencyModel
from distserve.planner.layouts import AUTO_SPLITS, DEFAULT_SPLITS, Layout, auto_splits, limits_from_config
from distserve.planner.profile import SharePoint, from_dict
from distserve.planner.simulator import Simulator
from distserve.planner.sm_shares import contended_share
from distserve.server.cli import build_parser
from distserve.server.config import DistServeConfig

from .test_sm_split_plan import CHEAP


def test_contended_share_divides_the_sms_in_proportion_to_overlapping_caps():
    assert contended_share(100, 50) == pytest.approx(200 / 3)
    assert contended_share(50, 100) == pytest.approx(100 / 3)
    assert contended_share(100, 100) == contended_share(70, 70) == 50.0
    assert contended_share(80, 50) == pytest.approx(8000 / 130)
    assert contended_share(60, 40) == 60.0 and contended_share(30, 70) == 30.0  # disjoint: no contention
    assert contended_share(30, 90) == pytest.approx(25.0)  # never more than the cap, shares add to 100
    assert contended_share(30, 90) + contended_share(90, 30) == pytest.approx(100.0)


# prefill 1000 tokens: 100 ms on the whole GPU; a decode step: 10 ms; the share curve SM-bound below 50 % and
# linear between the measured 50 % (2x) and 100 %
MODEL = LatencyModel(
    10.0,
    0.1,
    0.0,
    0.0,
    0.0,
    0.0,
    0.0,
    0.0,
    {},
    sm_scale={"prefill": ((50, 2.0), (100, 1.0)), "decode": ((50, 2.0), (100, 1.0))},
)


def _ttfts(split: tuple[int, int], requests: list[tuple[float, int, int]]) -> list[float]:
    pf, dec, _ = limits_from_config(DistServeConfig(), 0)
    sim = Simulator(MODEL, Layout("disaggregated", 1, 1, pf, dec, sm_split=split), 0, reply_after_next_step=False)
    res = sim.run(requests)
    return [x["ttft"] for x in res.latencies]


def test_a_prefill_alone_runs_on_its_cap_and_beside_a_decode_step_on_the_contended_share():
    alone, beside = _ttfts((100, 50), [(0.0, 1000, 60), (300.0, 1000, 2)])  # the second arrives mid-decode
    assert alone == pytest.approx(100.0)  # the decode worker idle: every SM
    assert beside == pytest.approx(100.0 * MODEL.share_scale("prefill", 200 / 3))  # 66.7 %: 1.67x, 166.7 ms
    disjoint = _ttfts((50, 50), [(0.0, 1000, 60), (300.0, 1000, 2)])
    assert disjoint == pytest.approx([200.0, 200.0])  # 50 % whether or not the decode worker runs
    both_full = _ttfts((100, 100), [(0.0, 1000, 60), (300.0, 1000, 2)])
    assert both_full == pytest.approx([100.0, 200.0])  # 100:100 = unpartitioned: half each while both run


def test_a_step_is_retimed_when_the_other_worker_starts_mid_step():
    # the second prompt arrives while the first request's decode is idle... then its decode starts mid-prefill:
    # prompt 1 (t 0..100 alone), then prompt 2 from t=100 beside the decode of request 1 from t=100 on
    (a, b) = _ttfts((100, 50), [(0.0, 1000, 40), (50.0, 1000, 2)])
    assert a == pytest.approx(100.0)
    # prompt 2 waits for the step of prompt 1 (ends at 100), then runs beside request 1's decode: 166.7 ms
    assert b == pytest.approx(50.0 + 100.0 * MODEL.share_scale("prefill", 200 / 3))


def test_a_host_bound_prefill_step_leaves_the_sms_to_the_decode_worker_most_of_its_time():
    host = dataclasses.replace(MODEL, prefill_floor_ms=50.0)
    assert host.gpu_fraction([(100, 0)], 0, 0) == pytest.approx(10.0 / 50.0)  # 10 ms of GPU work in a 50 ms step
    assert host.gpu_fraction([(1000, 0)], 0, 0) == 1.0
    assert host.gpu_fraction([], 8, 800) == 1.0  # decode steps fill the GPU
    assert host.step_ms([(100, 0)], 0, 0, sm_share=50) == 50.0  # the host side does not slow with fewer SMs
    assert host.step_ms([(1000, 0)], 0, 0, sm_share=50) == pytest.approx(200.0)


def test_auto_grid_has_the_overlapping_splits_inside_the_curve_and_no_wrong_share():
    assert set(DEFAULT_SPLITS) < set(AUTO_SPLITS) and (100, 50) in AUTO_SPLITS and (80, 50) in AUTO_SPLITS
    assert all(100 < p + d <= 150 for p, d in AUTO_SPLITS if (p, d) not in DEFAULT_SPLITS)
    got = auto_splits({"prefill": 30, "decode": 50}, frozenset({40, 45, 80}))
    assert (100, 50) in got and (50, 50) in got and (30, 90) in got and (30, 70) in got
    assert not any(s in (40, 45, 80) for split in got for s in split)
    assert not any(d < 50 for _, d in got)  # below the decode curve: never extrapolated in auto


def _args(*extra: str):
    return build_parser().parse_args(
        ["plan", "--profile", "PROFILE", "--workload", "prompt=1024,output=64", "--slo", "ttft:250ms,tpot:50ms"]
        + ["--devices", "1", *extra]
    )


def _profile(tmp_path, shares=CHEAP, wrong=(), notes=()):
    from distserve.planner.profile import load

    prof = dataclasses.replace(load("h200-llama2-7b"), sm_shares=shares, sm_shares_wrong=wrong, notes=notes)
    path = tmp_path / "h200_sm.json"
    prof.save(path)
    return str(path)


def test_auto_never_plans_a_share_the_profile_recorded_wrong(tmp_path):
    args = _args("--sm-splits", "auto")
    args.profile = _profile(tmp_path, wrong=(50,))
    got = _inputs(args)
    assert not isinstance(got, int)
    splits = [lay.sm_split for lay in got[2] if lay.sm_split]
    assert (100, 50) not in splits and (50, 50) not in splits and not any(50 in s for s in splits)
    assert (100, 30) in splits and (70, 30) in splits  # overlapping and disjoint splits both searched
    # a profile written before sm_shares_wrong: the note `distserve profile --sm-shares` writes says the same
    args.profile = _profile(tmp_path, notes=("share 50 % not measured: a bf16 GEMM of 1 x 4096 ... gave 3 wrong",))
    got = _inputs(args)
    assert not isinstance(got, int) and not any(50 in lay.sm_split for lay in got[2] if lay.sm_split)


def _curve(decode: dict[int, float], prefill: dict[int, float]) -> tuple[SharePoint, ...]:
    pts = []
    for phase, scales, shapes in (
        ("decode", decode, ((16, 512, 6.9), (64, 1024, 13.8))),
        ("prefill", prefill, ((1, 512, 12.5), (1, 2048, 49.0))),
    ):
        for batch, size, base in shapes:
            pts.append(SharePoint(phase, 100, batch, size, base))
            pts += [SharePoint(phase, s, batch, size, base * k) for s, k in scales.items()]
    return tuple(pts)


# an H200-like curve (bench.planner.h200_profile.share_points): prefill compute-bound, decode nearly bandwidth-bound
H200_LIKE = _curve({50: 1.12}, {50: 1.58, 60: 1.42})


def test_the_search_proposes_an_overlapping_split_where_the_curve_makes_it_best(tmp_path):
    (tmp_path / "seq.yaml").write_text("prefill:\n  max_seq_len: 4096\n")
    p = subprocess.run(
        [sys.executable, "-m", "distserve.server.cli", "plan", "--profile", _profile(tmp_path, H200_LIKE)]
        + ["--workload", "prompt=2048,output=128", "--slo", "ttft:250ms,tpot:50ms", "--devices", "1"]
        + ["--num-requests", "60", "--top", "8", "--config", str(tmp_path / "seq.yaml")]
        + ["--sm-splits", "50:50,60:50,100:50"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        check=False,
    )
    assert p.returncode == 0, p.stderr
    ranked = p.stdout.split("best layouts on")[1].splitlines()[1:]
    assert ranked[0].startswith("1P1D on 1 GPU, SM 100:50"), p.stdout  # prefill on every SM while decode idles
    assert "1 colocated" in p.stdout and "SM 50:50" in p.stdout
    assert "--prefill 1 --decode 1 --devices cuda:0 --sm-split 100:50" in p.stdout.split("deploy the winner:")[1]


@pytest.mark.parametrize(
    "value, words",
    [
        ("60-40", "'60-40'"),
        ("100:50:10", "'100:50:10'"),
        ("0:50", "'0:50'"),
        ("100:150", "'100:150'"),
        ("100:50,100:50", "'100:50' twice"),
        ("auto,100:50", "'auto,100:50'"),
        ("45:70", "45:70 uses 45 %"),
    ],
)
def test_bad_sm_splits_exit_2_with_one_sentence_naming_the_value(tmp_path, value, words):
    path = _profile(tmp_path, wrong=(40, 45))
    p = subprocess.run(
        [sys.executable, "-m", "distserve.server.cli", "plan", "--profile", path, "--devices", "1"]
        + ["--workload", "prompt=128,output=16", "--slo", "ttft:250ms,tpot:50ms", "--sm-splits", value],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert p.returncode == 2 and p.stdout == "", p.stdout + p.stderr
    assert p.stderr.count("\n") == 1 and p.stderr.startswith("distserve: error: ") and words in p.stderr


def test_profile_keeps_wrong_shares_and_refuses_bad_ones(h200_profile):
    d = json.loads(json.dumps(dataclasses.replace(h200_profile, sm_shares=CHEAP, sm_shares_wrong=(40, 45)).to_dict()))
    assert from_dict(d).wrong_shares() == {40, 45}
    with pytest.raises(Exception, match="sm_shares_wrong"):
        from_dict({**d, "sm_shares_wrong": [0]})
    assert SharePoint("decode", 50, 1, 1, 1.0).origin == "measured"
