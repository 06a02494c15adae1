"""sla.spec: the shipped specs load; bad specs fail naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from distserve.sla.spec import SlaSpec, SpecError, load_spec

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "sla").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_specs_load(path):
    spec = load_spec(path)
    assert spec.window_s > 0 and spec.objectives


def test_default_spec_values():
    spec = load_spec(ROOT / "configs/sla/default.yaml")
    assert spec.availability == 0.999
    assert spec.objectives[0].name == "ttft_p99.9" and spec.objectives[0].threshold_ms == 300
    assert spec.objectives[0].allowed_share == pytest.approx(0.001)


@pytest.mark.parametrize(
    "doc, message",
    [
        ({"window_s": 60, "availabilty": 0.9}, "unknown key 'availabilty'; did you mean 'availability'?"),
        (
            {"window_s": 60, "objectives": [{"metric": "ttft", "percentile": 99, "treshold_ms": 5}]},
            "unknown key 'objectives[0].treshold_ms'; did you mean 'objectives[0].threshold_ms'?",
        ),
        (
            {"window_s": 60, "objectives": [{"metric": "latency", "percentile": 99, "threshold_ms": 5}]},
            "'objectives[0].metric' must be one of ttft, tpot, itl, e2e",
        ),
        (
            {"window_s": 60, "objectives": [{"metric": "ttft", "percentile": 100, "threshold_ms": 5}]},
            "'objectives[0].percentile' must be in (0, 100)",
        ),
        (
            {"window_s": 60, "objectives": [{"metric": "ttft", "percentile": 99, "threshold_ms": -1}]},
            "'objectives[0].threshold_ms' must be > 0",
        ),
        ({"window_s": 60, "availability": 1.5}, "'availability' must be in (0, 1]"),
        ({"availability": 0.9}, "'window_s' is required"),
        ({"window_s": 60}, "promises nothing"),
        ({"window_s": "1h", "availability": 0.9}, "'window_s' must be a number"),
    ],
)
def test_bad_specs(doc, message):
    with pytest.raises(SpecError) as e:
        SlaSpec.from_dict(doc)
    assert message in str(e.value)


def test_bad_file_names_file(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("window_s: 60\nobjectives: [{metric: ttft, percentile: 99, threshold_ms: 1, extra: 2}]\n")
    with pytest.raises(SpecError, match=r"s\.yaml: unknown key 'objectives\[0\]\.extra'"):
        load_spec(p)
    with pytest.raises(SpecError, match="cannot read spec"):
        load_spec(tmp_path / "missing.yaml")
