"""The wheel: one top-level import name (``distserve``), the files the commands read at run time, and commands
that work from a folder outside the checkout after a plain (non-editable) install into a fresh environment.

The wheel is built from a copy of the checkout (the build writes ``build/`` and ``*.egg-info`` where it runs)
with this environment's setuptools, and installed with ``--no-deps`` into a new venv whose only other path is
this environment's site-packages (torch, fastapi, ...: the dependencies, not distserve: the editable install's
hook there is not loaded, as a path added by a ``.pth`` file has its own ``.pth`` files ignored).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("server", "distbench", "chaos", "sla", "reports", "configs", "ci", "planner")
NOT_COPIED = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", "bench", "tests", "docs", ".out"
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    pytest.importorskip("setuptools", reason="builds with this environment's setuptools (no index needed)")
    base = tmp_path_factory.mktemp("wheel")
    src = base / "src"
    shutil.copytree(ROOT, src, symlinks=True, ignore=NOT_COPIED)
    out = base / "dist"
    p = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    (whl,) = out.glob("distserve-*.whl")
    return whl


@pytest.fixture(scope="module")
def env(wheel, tmp_path_factory) -> Path:
    """A fresh venv with the wheel installed (no editable hook, no checkout on its path)."""
    venv = tmp_path_factory.mktemp("venv") / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    (site / "_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    p = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", "-q", str(wheel)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return venv


def _run(env: Path, cwd: Path, program: str, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``program`` (python, distserve, distbench) of ``env``, run in ``cwd`` with no path of this session."""
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    return subprocess.run(
        [str(env / "bin" / program), *argv], cwd=cwd, env=environ, capture_output=True, text=True, timeout=timeout
    )


def test_the_wheel_installs_one_top_level_name_and_every_module(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    info = "distserve-{}.dist-info".format(wheel.name.split("-")[1])
    assert {n.split("/")[0] for n in names} == {"distserve", info}
    shipped = set(names)
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            if "__pycache__" not in f.parts:
                assert f"distserve/{f.relative_to(ROOT).as_posix()}" in shipped, f
    assert {"distserve/__init__.py", "distserve/__main__.py"} <= shipped
    entry = zipfile.ZipFile(wheel).read(f"{info}/entry_points.txt").decode()
    assert "distserve = distserve.server.cli:main" in entry and "distbench = distserve.distbench.cli:main" in entry


def test_the_wheel_carries_the_files_the_commands_read(wheel):
    shipped = set(zipfile.ZipFile(wheel).namelist())
    data = [
        *(ROOT / "configs").rglob("*.yaml"),
        *(ROOT / "configs").rglob("*.json"),
        ROOT / "ci" / "release_gate.yaml",
        *(ROOT / "planner" / "profiles").glob("*.json"),
        *(ROOT / "server" / "engine" / "data").glob("*.txt"),  # decode.fp8_weight_rounding gptq's calibration text
    ]
    assert len(data) > 15
    missing = [str(f.relative_to(ROOT)) for f in data if f"distserve/{f.relative_to(ROOT).as_posix()}" not in shipped]
    assert not missing, f"not in the wheel: {missing}"


def test_installed_commands_work_outside_the_checkout(env, tmp_path):
    where = _run(
        env,
        tmp_path,
        "python",
        "-c",
        "import distserve, importlib.util as u; print(distserve.__file__, u.find_spec('server'))",
    )
    assert where.returncode == 0, where.stderr
    path, spec = where.stdout.split()
    assert Path(path).is_relative_to(env) and spec == "None", where.stdout  # the wheel's copy, no `server`

    p = _run(env, tmp_path, "python", "-m", "distserve", "--help")
    assert p.returncode == 0 and "serve" in p.stdout, p.stderr
    p = _run(env, tmp_path, "distserve", "--version")
    assert p.returncode == 0 and p.stdout.strip(), p.stderr
    p = _run(env, tmp_path, "distbench", "--help")
    assert p.returncode == 0 and "run" in p.stdout, p.stderr

    # a shipped config by its checkout name, read from a folder that has none
    p = _run(env, tmp_path, "distserve", "doctor", "--config", "configs/distserve_config.yaml", "--only", "model")
    assert p.returncode == 0, p.stdout + p.stderr
    p = _run(env, tmp_path, "distserve", "doctor", "--config", "configs/nosuch.yaml", "--only", "model")
    assert p.returncode == 2 and "configs/nosuch.yaml" in p.stderr, p.stderr
    # the shipped planner profile by name
    p = _run(
        env, tmp_path, "distserve", "plan", "--profile", "h200-llama2-7b", "--workload", "prompt=512,output=64",
        "--slo", "ttft:250ms,tpot:50ms", "--devices", "2",
    )  # fmt: skip
    assert p.returncode == 0 and "distserve serve" in p.stdout, p.stdout + p.stderr


def test_the_installed_gate_reads_its_checklist_and_skips_the_checkouts_tests(env, tmp_path):
    out = tmp_path / "gate"
    p = _run(env, tmp_path, "distserve", "gate", "--only", "tests", "--out", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    (item,) = json.loads((out / "gate.json").read_text())["items"]
    assert item["status"] == "skipped" and "checkout" in item["detail"], item
    # every file a quick gate item names resolves to the installed copy
    code = (
        "import sys, yaml; from distserve.configs import find; "
        "spec = yaml.safe_load(find('ci/release_gate.yaml').read_text()); "
        "files = [i['file'] for i in spec['items'] if 'file' in i] + ['configs/sla/demo.yaml']; "
        "print('\\n'.join(str(find(f)) for f in files))"
    )
    p = _run(env, tmp_path, "python", "-c", code)
    assert p.returncode == 0, p.stderr
    found = [Path(line) for line in p.stdout.split()]
    items = yaml.safe_load((ROOT / "ci" / "release_gate.yaml").read_text())["items"]
    assert len(found) == sum("file" in i for i in items) + 1 > 1
    assert all(f.is_file() and f.is_relative_to(env) for f in found), found
