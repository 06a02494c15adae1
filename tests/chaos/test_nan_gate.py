"""`distserve chaos nan-check` and `distserve gate`: each passes on a good build and can fail."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file, save_file

from distserve.chaos.nan_check import lengths
from tests.chaos.conftest import ROOT


def _cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "distserve.server.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_lengths_around_powers_of_two():
    assert lengths(64, 4) == [15, 16, 17, 31, 32, 33, 63, 64]
    assert lengths(2048)[-3:] == [1025, 2047, 2048]


def test_nan_check_passes_on_the_tiny_model(tmp_path):
    p = _cli("chaos", "nan-check", "--max-len", "66", "--json", str(tmp_path / "nan.json"))
    assert p.returncode == 0, p.stdout + p.stderr
    r = json.loads((tmp_path / "nan.json").read_text())
    assert r["backends"]["sdpa"]["lengths"] == {str(n): "ok" for n in lengths(66)}
    assert "| 64 |" in p.stdout


def test_nan_check_fails_on_a_poisoned_model(tmp_path):
    """A model with one NaN embedding row: any prompt holding that token has non-finite logits."""
    from distserve.server.engine.tiny_model import make_tiny_model

    folder = Path(make_tiny_model(tmp_path / "m", layers=1, hidden=64, heads=2, kv_heads=2))
    w = load_file(str(folder / "model.safetensors"))
    for tok in range(3, 259):
        w["model.embed_tokens.weight"][tok, 0] = float("nan") if tok % 2 else w["model.embed_tokens.weight"][tok, 0]
    save_file(w, str(folder / "model.safetensors"))
    p = _cli("chaos", "nan-check", "--model", str(folder), "--max-len", "40", "--json", str(tmp_path / "nan.json"))
    assert p.returncode == 1
    r = json.loads((tmp_path / "nan.json").read_text())
    assert any("NaN in prefill" in f for f in r["failures"])
    assert torch.isnan(w["model.embed_tokens.weight"]).any()


def test_gate_go_and_no_go(tmp_path):
    checklist = {
        "title": "test gate",
        "items": [
            {
                "id": "ok",
                "title": "a passing command",
                "kind": "command",
                "argv": ["{python}", "-c", "print('fine')"],
                "quick": True,
            },
            {
                "id": "missing",
                "title": "a command this build lacks",
                "kind": "command",
                "needs_command": ["no-such-command"],
                "argv": ["false"],
                "quick": True,
            },
            {
                "id": "bad",
                "title": "a failing command",
                "kind": "command",
                "argv": ["{python}", "-c", "raise SystemExit(3)"],
                "quick": False,
            },
        ],
    }
    path = tmp_path / "gate.yaml"
    path.write_text(yaml.safe_dump(checklist))
    quick = _cli("gate", "--checklist", str(path), "--quick", "--out", str(tmp_path / "q"))
    assert quick.returncode == 0, quick.stdout + quick.stderr
    rq = json.loads((tmp_path / "q" / "gate.json").read_text())
    assert rq["verdict"] == "go" and [i["status"] for i in rq["items"]] == ["passed", "skipped"]
    assert "not available" in rq["items"][1]["detail"]
    full = _cli("gate", "--checklist", str(path), "--out", str(tmp_path / "f"))
    assert full.returncode == 1 and "[ FAIL ]" in full.stdout
    rf = json.loads((tmp_path / "f" / "gate.json").read_text())
    assert rf["verdict"] == "no-go" and rf["items"][2]["detail"].startswith("exit 3")
    assert "**NO-GO**" in (tmp_path / "f" / "gate.md").read_text()


def test_gate_bad_checklist_exits_2(tmp_path):
    assert _cli("gate", "--checklist", str(tmp_path / "nope.yaml")).returncode == 2
    (tmp_path / "g.yaml").write_text(yaml.safe_dump({"items": [{"id": "x", "title": "x", "kind": "teleport"}]}))
    p = _cli("gate", "--checklist", str(tmp_path / "g.yaml"))
    assert p.returncode == 2 and "teleport" in p.stderr
