"""`distserve sla audit` is honest about its input and its output: refused 503s count against
availability, a journal gap makes the verdict ``incomplete`` (never ``pass``), NaN/Infinity/negative
latencies are refused naming the record, exit 2 (one sentence, no traceback) for bad input or an
unwritable folder, 1 only for a failed SLA; reports land as a whole, also with two audits at once."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import yaml

from distserve.sla.cli import main as sla_main

SPEC = {"name": "t", "window_s": 3600, "availability": 0.9, "objectives": []}
T0 = 1_800_000_000.0


def _journal(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def _req(i: int, status: int = 200, **kw) -> dict:
    ok = status == 200
    return {
        "kind": "request",
        "status": status,
        "start_unix": T0 + i,
        "pool": "primary",
        "ttft": 0.1 if ok else None,
        "tpot": None,
        "e2e": 0.2 if ok else None,
        "itl": [],
        "error": None if ok else f"HTTP {status}",
        **kw,
    }


def _audit(tmp_path: Path, journal: Path, out: str = "out", capsys=None) -> int:
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(SPEC))
    return sla_main(["audit", "--spec", str(spec), "--results", str(journal), "--out", str(tmp_path / out)])


def test_refused_requests_count_against_availability_and_client_faults_do_not(tmp_path):
    lines = [_req(i) for i in range(10)] + [_req(10 + i, 503) for i in range(10)]
    assert _audit(tmp_path, _journal(tmp_path / "j.jsonl", lines)) == 1  # 50 % < 90 %: the SLA failed
    report = json.loads((tmp_path / "out" / "compliance.json").read_text())
    assert report["verdict"] == "fail" and report["num_requests"] == 20
    lines = [_req(i) for i in range(10)] + [_req(10 + i, 400) for i in range(10)] + [_req(30, 499)]
    assert _audit(tmp_path, _journal(tmp_path / "j.jsonl", lines)) == 0  # 400/499: the client's doing
    report = json.loads((tmp_path / "out" / "compliance.json").read_text())
    assert report["num_requests"] == 10 and report["client_errors"] == 11


@pytest.mark.parametrize(
    "gap",
    [
        {"kind": "journal_gap", "since_unix": T0 + 3.5, "until_unix": T0 + 4.5, "dropped": 7},
        {"kind": "journal_gap", "since_unix": T0 + 3.5, "open": True},  # the router never wrote again
    ],
)
def test_a_journal_gap_makes_the_audit_incomplete_not_pass(tmp_path, capsys, gap):
    lines = [_req(i) for i in range(4)] + [gap] + [_req(i) for i in range(5, 9)]
    assert _audit(tmp_path, _journal(tmp_path / "j.jsonl", lines)) == 3
    report = json.loads((tmp_path / "out" / "compliance.json").read_text())
    assert report["verdict"] == "incomplete" and len(report["journal_gaps"]) == 1
    assert report["dropped_records"] == gap.get("dropped", 0)
    avail = [r for r in report["rows"] if r["objective"] == "availability"]
    assert [r["status"] for r in avail] == ["incomplete"]
    assert "availability not judged" in capsys.readouterr().err


@pytest.mark.parametrize(
    "bad, field",
    [('"ttft": NaN', "ttft"), ('"e2e": Infinity', "e2e"), ('"tpot": -0.5', "tpot"), ('"itl": [0.1, NaN]', "itl")],
)
def test_non_finite_or_negative_latencies_are_refused_naming_the_record(tmp_path, capsys, bad, field):
    good = json.dumps(_req(0))
    line = good.replace('"ttft": 0.1', bad) if field == "ttft" else good[:-1] + ", " + bad + "}"
    (tmp_path / "j.jsonl").write_text(good + "\n" + line + "\n")
    assert _audit(tmp_path, tmp_path / "j.jsonl") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "j.jsonl" in err and "request 2" in err and field in err, err
    assert not (tmp_path / "out").exists()


def test_an_unwritable_out_folder_is_exit_2_in_one_sentence(tmp_path, capsys):
    (tmp_path / "blocker").write_text("a file where a folder should be")
    journal = _journal(tmp_path / "j.jsonl", [_req(0)])
    assert _audit(tmp_path, journal, out="blocker/report") == 2
    err = capsys.readouterr().err
    assert err.startswith("distserve sla: error:") and err.count("\n") == 1 and "Traceback" not in err


def test_two_audits_into_one_folder_leave_one_complete_set(tmp_path):
    a = _journal(tmp_path / "a.jsonl", [_req(i) for i in range(50)])
    b = _journal(tmp_path / "b.jsonl", [_req(i) for i in range(80)])
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(SPEC))
    codes: list[int] = []

    def run(journal: Path) -> None:
        for _ in range(5):
            codes.append(
                sla_main(
                    ["audit", "--spec", str(tmp_path / "spec.yaml"), "--results", str(journal)]
                    + ["--out", str(tmp_path / "out"), "--formats", "json,csv,markdown"]
                )
            )

    threads = [threading.Thread(target=run, args=(j,)) for j in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert codes == [0] * 10
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["compliance.csv", "compliance.json", "summary.md"]
    report = json.loads((out / "compliance.json").read_text())
    assert report["audit_id"] in (out / "compliance.csv").read_text()  # one audit's set, not a mix
    assert report["audit_id"] in (out / "summary.md").read_text()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.")] == [".out.lock"]  # no temp left
