"""distbench compare/merge refuse corrupt results with exit status 2 and one sentence naming the file
and the field (a real result file, corrupted one field at a time), and still accept the real one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distserve.distbench import result
from distserve.distbench.cli import main as distbench_main
from distserve.distbench.records import RequestRecord


def _real(path: Path) -> Path:
    """A result written by distbench's own writer (two completed requests)."""
    recs = [
        RequestRecord(
            index=i,
            scheduled=0.1 * i,
            sent=0.1 * i,
            start_unix=1e9 + i,
            ttft=0.05,
            ttft_service=0.05,
            e2e=0.2,
            itl=[0.05, 0.05],
            prompt_tokens=8,
            output_tokens=3,
        )
        for i in range(2)
    ]
    return result.save(result.build(recs, 2.0, 1e9, {"strategy": "closed"}, (50, 99), {}, {}), path)


@pytest.mark.parametrize(
    "corrupt, field",
    [
        (lambda d: d["requests"][1].update(ttft=float("nan")), "requests[1].ttft"),
        (lambda d: d["requests"][0].update(e2e=-1.0), "requests[0].e2e"),
        (lambda d: d["requests"][0].update(itl=[0.1, "x"]), "requests[0].itl"),
        (lambda d: d.update(completed=-3), "completed"),
        (lambda d: d.update(end_unix=1.0), "end_unix"),
        (lambda d: d["histograms"].update(ttft="not-a-histogram"), "histograms.ttft"),
        (lambda d: d.update(requests={"a": 1}), "requests"),
        (lambda d: d.pop("start_unix"), "start_unix"),
    ],
)
def test_compare_and_merge_refuse_a_corrupt_result(tmp_path, capsys, corrupt, field):
    good = _real(tmp_path / "good.json")
    doc = json.loads(good.read_text())
    corrupt(doc)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    for argv in (["compare", str(good), str(bad)], ["merge", str(good), str(bad), "-o", str(tmp_path / "m.json")]):
        assert distbench_main(argv) == 2
        err = capsys.readouterr().err
        assert "bad.json" in err and field in err and err.count("\n") == 1, err
    assert not (tmp_path / "m.json").exists()


def test_a_valid_result_still_merges(tmp_path):
    good = _real(tmp_path / "good.json")
    assert distbench_main(["merge", str(good), str(good), "-o", str(tmp_path / "m.json")]) == 0
    assert json.loads((tmp_path / "m.json").read_text())["completed"] == 4
