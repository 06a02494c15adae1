"""CUDA MPS SM split: the launcher's daemon and its clients' environment, against a fake
``nvidia-cuda-mps-control`` on the PATH that records its arguments, environment and stdin."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from distserve.server.commands.serve import sm_split_problem, with_sm_split
from distserve.server.config import DistServeConfig
from distserve.server.engine.presets import counter_normal
from distserve.server.mps import (
    LOG_ENV,
    MEM_ENV,
    PIPE_ENV,
    PREFIX,
    THREADS_ENV,
    MpsDaemon,
    MpsUnavailable,
    expected_sms,
    parse_sm_split,
    sweep_stale_daemons,
)
from tests.unit.test_memory_budget import _RecordingLauncher

FAKE = r"""#!{python}
import json, os, sys
pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "")
stdin = "" if "-d" in sys.argv else sys.stdin.read()
with open(os.environ["FAKE_MPS_LOG"], "a") as f:
    f.write(json.dumps({{"argv": sys.argv[1:], "pipe": pipe, "log": os.environ.get("CUDA_MPS_LOG_DIRECTORY"),
                        "stdin": stdin}}) + "\n")
if os.environ.get("FAKE_MPS_FAIL"):
    print("An instance of this daemon is already running", file=sys.stderr)
    sys.exit(1)
if "-d" in sys.argv:
    open(os.path.join(pipe, "control"), "w").close()
elif stdin.strip() == "quit":
    os.remove(os.path.join(pipe, "control"))
"""


@pytest.fixture()
def fake_mps(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "nvidia-cuda-mps-control"
    exe.write_text(FAKE.format(python=sys.executable))
    exe.chmod(0o755)
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_MPS_LOG", str(log))
    monkeypatch.delenv(PIPE_ENV, raising=False)
    root = tmp_path / "tmp"
    root.mkdir()

    def calls():
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    return root, calls


def test_split_flag_parsing_and_config():
    assert parse_sm_split("60:40") == (60, 40)
    for bad in ("60", "60:40:0", "0:50", "60:101", "a:b", "-1:50"):
        with pytest.raises(ValueError, match="--sm-split"):
            parse_sm_split(bad)
    cfg = with_sm_split(DistServeConfig(), (70, 30))
    assert (cfg.prefill.sm_share, cfg.decode.sm_share) == (70, 30)
    with pytest.raises(Exception, match="prefill.sm_share"):
        DistServeConfig.from_dict({"prefill": {"sm_share": 101}})
    assert sm_split_problem(DistServeConfig(), "disaggregated", ["cuda"]) is None  # no split: today's behaviour
    msg = sm_split_problem(cfg, "disaggregated", ["cpu"])
    assert msg is not None and "--device cuda" in msg
    assert expected_sms(132, 40) == 53 and expected_sms(132, 100) == 132


def test_refuses_in_one_sentence_without_mps(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no control binary
    cfg = with_sm_split(DistServeConfig(), (60, 40))
    msg = sm_split_problem(cfg, "disaggregated", ["cuda:0"])
    assert msg is not None and "nvidia-cuda-mps-control is not on the PATH" in msg and "\n" not in msg
    with pytest.raises(MpsUnavailable, match="not on the PATH"):
        MpsDaemon(root=str(tmp_path)).start()


def test_daemon_started_in_a_private_folder_and_stopped_with_quit(fake_mps):
    root, calls = fake_mps
    d = MpsDaemon(root=str(root)).start()
    assert d.started and d.folder is not None and d.folder.name.startswith(f"{PREFIX}{os.getpid()}-")
    for f in (d.folder, d.pipe_dir, d.log_dir):
        assert stat.S_IMODE(f.stat().st_mode) == 0o700
    assert calls() == [{"argv": ["-d"], "pipe": str(d.pipe_dir), "log": str(d.log_dir), "stdin": ""}]
    env = d.env(40, 90000, 0)
    assert env == {
        PIPE_ENV: str(d.pipe_dir),
        LOG_ENV: str(d.log_dir),
        THREADS_ENV: "40",
        MEM_ENV: "0=90000M",
    }
    folder = d.folder
    d.stop()
    assert calls()[-1] == {"argv": [], "pipe": str(d.pipe_dir), "log": str(d.log_dir), "stdin": "quit\n"}
    assert not folder.exists() and not d.started


def test_a_daemon_that_does_not_start_is_refused_and_leaves_nothing(fake_mps, monkeypatch):
    root, _ = fake_mps
    monkeypatch.setenv("FAKE_MPS_FAIL", "1")
    with pytest.raises(MpsUnavailable, match="did not start .exit 1: An instance of this daemon is already running"):
        MpsDaemon(root=str(root)).start()
    assert list(root.iterdir()) == []


def test_a_running_daemon_is_joined_and_left_running(fake_mps, tmp_path, monkeypatch):
    root, calls = fake_mps
    pipe = tmp_path / "theirs" / "pipe"
    pipe.mkdir(parents=True)
    (pipe / "control").touch()
    monkeypatch.setenv(PIPE_ENV, str(pipe))
    d = MpsDaemon(root=str(root)).start()
    assert not d.started and d.env(50)[PIPE_ENV] == str(pipe) and "joined" in d.events[-1]
    d.stop()
    assert calls() == [] and (pipe / "control").exists()


def test_stale_daemon_of_a_killed_launcher_is_quit_and_removed_at_the_next_start(fake_mps):
    root, calls = fake_mps
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = root / f"{PREFIX}{dead.pid}-abc"
    (stale / "pipe").mkdir(parents=True)
    (stale / "log").mkdir()
    stale.chmod(0o700)
    (stale / "pipe" / "control").touch()
    alive = root / f"{PREFIX}{os.getpid()}-live"  # a running launcher's: left alone
    alive.mkdir(mode=0o700)
    open_to_all = root / f"{PREFIX}{dead.pid}-shared"  # not private: never trusted, never touched
    open_to_all.mkdir()
    open_to_all.chmod(0o777)
    d = MpsDaemon(root=str(root)).start()
    assert {"argv": [], "pipe": str(stale / "pipe"), "log": str(stale / "log"), "stdin": "quit\n"} in calls()
    assert not stale.exists() and alive.exists() and open_to_all.exists()
    assert any("a launcher that is gone" in e for e in d.events)
    d.stop()
    assert sweep_stale_daemons(str(root)) == []


def test_launcher_starts_each_split_worker_as_an_mps_client_and_stops_the_daemon(fake_mps, monkeypatch):
    root, calls = fake_mps
    monkeypatch.setattr("distserve.server.launcher.device_total_mib", lambda index: 143771)
    monkeypatch.setattr("distserve.server.launcher.device_sm_count", lambda index: 132)
    cfg = with_sm_split(DistServeConfig(), (60, 40))
    la = _RecordingLauncher(cfg, "disaggregated", 1, 1, "t", pinning="none", device="cuda:0")
    la.mps_root = str(root)
    la.events = []
    la.start()
    envs = {w.worker_id: w.env for w in la.supervised.values()}
    assert envs["prefill-0"][THREADS_ENV] == "60" and envs["decode-1"][THREADS_ENV] == "40"
    assert envs["prefill-0"][MEM_ENV] == f"0={int(0.27 * 143771) + 1024}M"
    # the decode worker maps the prefill worker's staging pool: MPS counts it against its limit
    assert envs["decode-1"][MEM_ENV] == f"0={int(0.63 * 143771) + 1024 + 2048 + 4096}M"
    assert envs["decode-1"]["DISTSERVE_DEVICE_SM_COUNT"] == "132"
    assert envs["decode-1"]["DISTSERVE_DEVICE_TOTAL_MIB"] == "143771"
    assert la.mps is not None and envs["decode-1"][PIPE_ENV] == str(la.mps.pipe_dir)
    folder = la.mps.folder
    la.stop()
    assert calls()[-1]["stdin"] == "quit\n" and folder is not None and not folder.exists()


def test_preset_weights_do_not_depend_on_the_launch_grid():
    import torch

    a = counter_normal(1 << 12, 0, 100, torch.device("cpu"))
    b = torch.cat([counter_normal(100, 0, 100, torch.device("cpu")), counter_normal(3996, 0, 200, torch.device("cpu"))])
    assert torch.equal(a, b)  # drawn in any pieces, the same values
    x = counter_normal(1 << 20, 3, 0, torch.device("cpu"))
    assert abs(x.mean().item()) < 0.01 and abs(x.std().item() - 1) < 0.01
