"""The benchmark suite's registry and runner (``bench/suite.yaml``, ``python -m bench``) and its results writer:
every study registered with real files and flags its script accepts, bad entries refused naming the field, the
runner's list / run / device-call / report forms, and the provenance every written result carries."""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.lib import results
from bench.lib.suite import SuiteError, load, module_path, parse

REPO = Path(__file__).resolve().parents[2]


def bench(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bench", *args], cwd=REPO, capture_output=True, text=True, timeout=120, **kw
    )


def test_every_bench_module_and_script_is_registered_and_every_flag_exists():
    suite = load()
    used = set(suite.helpers)
    for st in suite.studies.values():
        used.update(st.reports)
        used.update(st.modules)
        for step in st.steps:
            used.add(step.target)
            if step.kind != "module":
                continue
            src = module_path(step.target).read_text()
            for args in (step.args, *st.variants.values()):
                for a in args:
                    if a.startswith("--"):
                        assert f'"{a}"' in src, (st.id, a)  # the study's parser takes the flag
    files = {p for p in (REPO / "bench").rglob("*.py") if p.name not in ("__init__.py", "__main__.py")}
    files |= {p for p in (REPO / "bench").rglob("*.sh") if p.parent.name != "lib"}
    unregistered = []
    for p in sorted(files):
        rel = p.relative_to(REPO).as_posix()
        name = rel[:-3].replace("/", ".") if rel.endswith(".py") else rel
        if name not in used and name not in ("bench.lib.suite",):
            unregistered.append(rel)
    assert not unregistered, unregistered


def test_no_sys_path_edits_and_no_issue_or_letter_suffixed_names_in_bench():
    for p in (REPO / "bench").rglob("*"):
        rel = p.relative_to(REPO).as_posix()
        if rel.startswith("bench/results/") or "__pycache__" in rel:  # local outputs, git-ignored
            continue
        assert not re.search(r"issue\d|_i\d\d_|\d{4}-\d\d-\d\d[a-z]", p.name), rel
        if p.suffix == ".py":
            assert not re.search(r"sys\.path\.(insert|append)", p.read_text()), rel


def _minimal(**over) -> dict:
    study = {"id": "x", "subject": "engine", "device": "cpu", "measures": "m", "module": "bench.engine.engine_cpu"}
    study.update(over)
    return {"version": 1, "studies": [study]}


@pytest.mark.parametrize(
    "over, words",
    [
        ({"subject": "misc"}, "subject"),
        ({"device": "tpu"}, "device"),
        ({"module": "bench.engine.nothing"}, "no file bench/engine/nothing.py"),
        ({"measures": ""}, "measures"),
        ({"colour": "red"}, "unknown field 'colour'"),
        ({"baselines": ["bench/baselines/cpu/none.json"]}, "baselines: no file"),
        ({"variants": {"a": "--x"}}, "variants.a must be a list"),
        (
            {"module": None, "steps": [{"pytest": ["tests"]}, {"pytest": ["tests"]}], "variants": {"a": []}},
            "only a one-step study has variants",
        ),
    ],
)
def test_bad_registry_entries_are_refused_naming_the_field(over, words):
    data = _minimal(**over)
    if over.get("module", "") is None:
        del data["studies"][0]["module"]
    with pytest.raises(SuiteError, match=re.escape(words)):
        parse(data, REPO)


def test_duplicate_ids_are_refused():
    data = _minimal()
    data["studies"].append(dict(data["studies"][0]))
    with pytest.raises(SuiteError, match="listed twice"):
        parse(data, REPO)


def test_list_run_device_call_and_report(tmp_path):
    listed = bench("list")
    assert listed.returncode == 0, listed.stderr
    for sid in load().studies:
        assert re.search(rf"^{re.escape(sid)}\s", listed.stdout, re.M), sid
    dry = bench("run", "engine-gpu", "--dry-run", "--", "--skip", "anchors")
    lines = dry.stdout.splitlines()
    assert dry.returncode == 0 and len(lines) == 3 and "-m pytest tests/gpu" in lines[0]
    assert lines[2].endswith("bench/results/engine-gpu/gpu_engine.json --skip anchors")  # {out}, then the extra
    call = bench("run", "serving-slo-study", "--variant", "x4-2p2d", "--device-call")
    assert call.stdout.strip() == "bash bench/lib/device.sh serving-slo-study --variant x4-2p2d"
    bad = bench("run", "serving-slo-study", "--variant", "x9")
    assert bad.returncode == 2 and "no variant 'x9'" in bad.stderr and bad.stderr.count("\n") == 1
    assert bench("run", "nothing").returncode == 2
    rep = bench("report", "planner-cpu-check", "--lines", "3")
    assert rep.returncode == 0 and "plan_cpu_profile_2026-11-30.json" in rep.stdout and "sha256" in rep.stdout
    assert bench("report", "serving-sla-live-cost").returncode == 2  # no tracked baseline
    # the device form of a run: each step's log in $OUT, its tail printed
    dev = bench(
        "run", "planner-h200-profile", "--variant", "check", "--on-device", env={**os.environ, "OUT": str(tmp_path)}
    )
    assert dev.returncode == 0, dev.stdout + dev.stderr
    assert "up to date" in (tmp_path / "h200_profile.log").read_text() and "== h200_profile rc=0" in dev.stdout


def test_the_results_writer_stamps_commit_hardware_date_and_command(tmp_path):
    out = results.write_result(tmp_path / "r.json.gz", {"figure": 1.5}, argv=["bench/x.py", "--out", "r.json.gz"])
    doc = json.loads(gzip.decompress(out.read_bytes()))
    assert doc["figure"] == 1.5 and results.read_result(out) == doc
    prov = doc["provenance"]
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", prov["commit"])
    assert prov["hardware"]["cpu_cores"] >= 1 and prov["hardware"]["cpu"]
    assert re.match(r"\d{4}-\d\d-\d\dT", prov["date"]) and prov["command"].endswith("bench/x.py --out r.json.gz")


def test_one_gpu_points_never_resend_another_points_prompts():
    """The prefix cache is on by default: two points of a sweep with one seed would measure cache hits."""
    from bench.serving.gpu_sm_split import point_seed

    seeds = [
        point_seed(rate, sampling, prewarm)
        for rate in (3, 5, 20, 60, 100, 120)
        for sampling in ("greedy", "openai-default")
        for prewarm in (False, True)
    ]
    assert len(set(seeds)) == len(seeds)


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--sweep", "same"], "--sweep names same, not in --layouts"),
        (["--sweep", "colocated@2048", "--sampling", "greedy,openai-default"], "--sampling must be greedy"),
        (["--sweep", "colocated@2048", "--prewarm-rounds", "0"], "--prewarm-rounds must be at least 1"),
    ],
)
def test_the_split_bench_refuses_bad_flags_before_any_server_starts(tmp_path, flags, says):
    # both cost a device call once: the servers started, then nothing was measured
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "bench.serving.gpu_split_memory", "--layouts", "colocated@2048", "--out", str(out)]
    r = subprocess.run([*cmd, *flags], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and says in r.stdout, (r.returncode, r.stdout, r.stderr)
    assert not out.exists()
