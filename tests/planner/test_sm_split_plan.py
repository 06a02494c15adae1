"""The planner's SM-split search (issue 31) on synthetic share points over the recorded H200 profile: the profile
carries per-share step costs, the latency model scales a step by them, and ``distserve plan --devices 1`` weighs
1P1D on each split against colocated and prints ``--sm-split P:D`` when a split wins."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from distserve.planner.latency import LatencyModel, share_scales
from distserve.planner.layouts import Layout, split_layouts
from distserve.planner.profile import ProfileError, SharePoint, from_dict
from distserve.planner.sm_shares import measure_shares
from distserve.server.config import DistServeConfig


def _shares(decode: dict[int, float], prefill: dict[int, float]) -> tuple[SharePoint, ...]:
    """Points whose ratio to the 100 % step is the given scale, for two shapes per phase."""
    pts = []
    for phase, scales in (("decode", decode), ("prefill", prefill)):
        for batch, size, base in ((16, 512, 10.0), (64, 1024, 20.0)):
            pts.append(SharePoint(phase, 100, batch, size, base))
            pts += [SharePoint(phase, s, batch, size, base * k) for s, k in scales.items()]
    return tuple(pts)


# decode is bandwidth-bound (a minority of SMs keeps most of its speed); prefill is compute-bound
CHEAP = _shares({30: 1.25, 50: 1.08, 70: 1.02}, {30: 3.3, 50: 2.0, 70: 1.43})
HOPELESS = _shares({30: 12.0, 50: 10.0, 70: 8.0}, {30: 30.0, 50: 20.0, 70: 14.0})


def test_share_scales_interpolate_and_never_speed_a_step_up():
    s = share_scales(CHEAP)
    assert s["decode"][-1] == (100, 1.0) and s["decode"][0] == (30, pytest.approx(1.25))
    model = LatencyModel(0, 0, 0, 0, 0, 0, 0, 0, {}, sm_scale=s)
    assert model.share_scale("decode", 40) == pytest.approx((1.25 + 1.08) / 2)
    assert model.share_scale("prefill", 20) == pytest.approx(3.3 * 30 / 20)  # below the lowest: SM-bound
    assert model.share_scale("decode", 100) == 1.0
    faster = share_scales((SharePoint("decode", 100, 1, 1, 10.0), SharePoint("decode", 50, 1, 1, 9.0)))
    assert faster["decode"][0] == (50, 1.0)  # noise below 1 kept at 1
    with pytest.raises(ValueError, match="sm-shares"):
        LatencyModel(0, 0, 0, 0, 0, 0, 0, 0, {}).share_scale("decode", 50)


def test_the_simulated_step_on_a_split_is_the_whole_gpu_step_times_its_scale(h200_profile):
    model = LatencyModel.fit(dataclasses.replace(h200_profile, sm_shares=CHEAP))
    whole = model.decode_ms(32, 32 * 600)
    assert model.step_ms([], 32, 32 * 600, sm_share=50) == pytest.approx(whole * 1.08)
    assert model.prefill_ms([2048]) * 2.0 == pytest.approx(model.step_ms([(2048, 0)], 0, 0, sm_share=50))
    lay = split_layouts(DistServeConfig(), ((60, 40),))[0]
    assert isinstance(lay, Layout) and lay.devices("cuda") == 1 and "SM 60:40" in lay.name()


def test_profile_round_trips_share_points_and_refuses_bad_ones(h200_profile):
    d = json.loads(json.dumps(dataclasses.replace(h200_profile, sm_shares=CHEAP).to_dict()))
    assert from_dict(d).sm_shares == CHEAP
    for bad, words in (
        ({"phase": "both", "share": 50, "batch": 1, "size": 1, "ms": 1.0}, "phase"),
        ({"phase": "decode", "share": 150, "batch": 1, "size": 1, "ms": 1.0}, "1..100"),
        ({"phase": "decode", "share": 50, "batch": 1, "size": 1, "ms": -1.0}, "ms"),
    ):
        with pytest.raises(ProfileError, match=words):
            from_dict({**d, "sm_shares": [bad]})


def _plan(tmp_path, shares, *extra: str) -> subprocess.CompletedProcess:
    from distserve.planner.profile import load

    prof = dataclasses.replace(load("h200-llama2-7b"), sm_shares=shares)
    path = tmp_path / "h200_sm.json"
    prof.save(path)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "distserve.server.cli",
            "plan",
            "--profile",
            str(path),
            "--workload",
            "prompt=1024,output=64",
            "--slo",
            "ttft:250ms,tpot:50ms",
            "--devices",
            "1",
            "--num-requests",
            "60",
            "--top",
            "8",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        check=False,
    )


def test_plan_searches_the_split_and_prints_the_sm_split_command(tmp_path):
    p = _plan(tmp_path, CHEAP, "--sm-splits", "50:50,60:40,70:30")
    assert p.returncode == 0, p.stderr
    assert "1 colocated" in p.stdout and "SM 60:40" in p.stdout and "SM 70:30" in p.stdout
    first = p.stdout.split("best layouts on")[1].splitlines()[1]
    assert first.startswith("1P1D on 1 GPU, SM 70:30"), p.stdout  # cheap decode shares: the largest prefill share
    deploy = p.stdout.split("deploy the winner:")[1]
    assert "--prefill 1 --decode 1 --devices cuda:0 --sm-split 70:30" in deploy
    hopeless = _plan(tmp_path, HOPELESS, "--sm-splits", "60:40")
    assert hopeless.returncode == 0, hopeless.stderr
    assert "--mode colocated" in hopeless.stdout.split("deploy the winner:")[1]  # splits 10x slower never win


def test_split_search_needs_share_points_and_valid_splits(tmp_path):
    none = _plan(tmp_path, (), "--sm-splits", "60:40")
    assert none.returncode == 2 and "--sm-shares" in none.stderr
    bad = _plan(tmp_path, CHEAP, "--sm-splits", "60-40")
    assert bad.returncode == 2 and "P:D" in bad.stderr
    silent = _plan(tmp_path, (), "--sm-splits", "auto")  # auto without points: colocated only, no error
    assert silent.returncode == 0 and "SM " not in silent.stdout


def test_cpu_has_no_share_to_measure_and_bad_shares_exit_2(tmp_path):
    points, notes, wrong = measure_shares(None, "cpu", [30, 100], log=lambda s: None)
    assert points == [] and wrong == [] and "nothing to measure" in notes[0]
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "distserve.server.cli",
            "profile",
            "--sm-shares",
            "0,200",
            "--out",
            str(tmp_path / "p.json"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert p.returncode == 2 and "--sm-shares" in p.stderr
