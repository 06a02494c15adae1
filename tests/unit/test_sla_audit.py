"""sla.audit + reports: a synthetic run with one known breach window; every export agrees."""

from __future__ import annotations

import csv
import json
import math
import random
import sqlite3
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from distserve.sla.audit import COLUMNS, audit
from distserve.sla.cli import main as sla_main
from distserve.sla.records import RecordsError, load_records
from distserve.sla.spec import SlaSpec

ROOT = Path(__file__).resolve().parents[2]

SPEC = {
    "name": "synthetic",
    "window_s": 10,
    "availability": 0.99,
    "objectives": [
        {"metric": "ttft", "percentile": 99, "threshold_ms": 200},
        {"metric": "tpot", "percentile": 90, "threshold_ms": 40},
        {"metric": "itl", "percentile": 99.9, "threshold_ms": 500},
    ],
}
BREACH_WINDOW = 2  # seconds 20..30


def synthetic_result(path: Path, unix_base: float | None = None, failures_in: int | None = None) -> Path:
    """300 requests over 40 s; in window 2, 10% of TTFTs are 900 ms (a p99 breach), elsewhere < 150 ms."""
    rng = random.Random(1)
    reqs = []
    for i in range(400):
        t = i * 0.1
        w = int(t // 10)
        ttft = 0.9 if (w == BREACH_WINDOW and i % 10 == 0) else rng.uniform(0.02, 0.15)
        itl = [rng.uniform(0.01, 0.03) for _ in range(7)]
        r = {
            "index": i,
            "scheduled": t,
            "sent": t + 0.001,
            "ttft": ttft,
            "e2e": ttft + sum(itl),
            "itl": itl,
            "tpot": sum(itl) / 7,
            "prompt_tokens": 16,
            "output_tokens": 8,
            "error": None,
        }
        if failures_in is not None and w == failures_in and i % 20 == 0:
            r.update(ttft=None, e2e=None, itl=[], tpot=None, error="HTTP 503")
        if unix_base is not None:
            r["start_unix"] = unix_base + t
        reqs.append(r)
    path.write_text(json.dumps({"completed": 400, "requests": reqs}))
    return path


def spec_file(tmp: Path, **over) -> Path:
    p = tmp / "spec.yaml"
    p.write_text(json.dumps({**SPEC, **over}))  # JSON is YAML
    return p


def test_known_breach_window_is_exactly_the_one_reported(tmp_path):
    data = load_records([synthetic_result(tmp_path / "r.json")])
    assert data.clock == "relative"
    rep = audit(SlaSpec.from_dict(SPEC), data)
    failed = [(r.window_index, r.objective) for r in rep.rows if r.status == "fail"]
    assert failed == [(BREACH_WINDOW, "ttft_p99")]
    row = next(r for r in rep.rows if r.status == "fail")
    assert row.observed == pytest.approx(900, rel=1e-3) and row.samples == 100 and row.violations == 10
    assert row.allowed_violations == pytest.approx(1.0) and row.budget_used == pytest.approx(10.0)
    assert row.window_start == "20" and row.window_start_s == 20
    assert rep.verdict == "fail"
    assert rep.worst(1)[0] == row
    ok = next(r for r in rep.rows if r.window_index == 0 and r.objective == "ttft_p99")
    # a P99 of 100 samples has 1 above it: not judged (the breach above has 10 violations: judged, failed)
    assert ok.status == "insufficient_data" and ok.violations == 0 and ok.observed < 150
    itl = next(r for r in rep.rows if r.window_index == 0 and r.objective == "itl_p99.9")
    assert itl.samples == 100 * 7
    assert len({r.window_index for r in rep.rows}) == 4


def test_wall_clock_windows_and_availability(tmp_path):
    base = 1_764_547_200.0  # 2025-12-01T00:00:00Z, a multiple of 10
    data = load_records([synthetic_result(tmp_path / "r.json", unix_base=base + 5, failures_in=0)])
    assert data.clock == "unix"
    rep = audit(SlaSpec.from_dict(SPEC), data)
    # starts at +5 s: five windows aligned to the clock; the failures (every 20th request of the first
    # 10 s of the run) fall into the first two: 3 of 50 requests, then 2 of 100
    starts = sorted({r.window_start for r in rep.rows})
    assert starts[0] == "2025-12-01T00:00:00Z" and len(starts) == 5
    avail = [r for r in rep.rows if r.objective == "availability" and r.status == "fail"]
    assert [(r.violations, r.samples) for r in avail] == [(3, 50), (2, 100)]
    assert avail[0].observed == pytest.approx(47 / 50) and avail[1].budget_used == pytest.approx(2.0)


def test_records_adapter_reads_router_journal(tmp_path):
    j = tmp_path / "journal.jsonl"
    lines = [
        {
            "kind": "request",
            "start_unix": 100.0 + i,
            "ttft": 0.05,
            "tpot": 0.01,
            "e2e": 0.2,
            "itl": [0.01],
            "error": None,
            "pool": "primary" if i % 2 else "backup",
        }
        for i in range(6)
    ]
    lines.insert(2, {"kind": "breaker", "at_unix": 101.5, "from_state": "closed", "to_state": "open"})
    j.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    data = load_records([j])
    assert len(data.records) == 6 and data.clock == "unix" and data.records[1].pool == "primary"
    with pytest.raises(RecordsError, match="lack 'start_unix'"):
        load_records([j, synthetic_result(tmp_path / "r.json")])


def test_records_adapter_skips_warmup_and_unset_wall_clock(tmp_path):
    p = tmp_path / "r.json"
    reqs = [
        {"index": -1, "scheduled": 0.0, "start_unix": 50.0, "ttft": 9.0, "e2e": 9.5, "error": None, "warmup": True},
        {
            "index": 0,
            "scheduled": 0.5,
            "start_unix": 100.5,
            "ttft": 0.1,
            "e2e": 0.3,
            "error": None,
            "warmup": False,
            "ttft_service": 0.09,
        },
    ]
    p.write_text(json.dumps({"requests": reqs}))
    data = load_records([p])
    assert [r.start for r in data.records] == [100.5] and data.clock == "unix"
    reqs[1]["start_unix"] = 0.0  # a writer that did not record wall-clock times
    p.write_text(json.dumps({"requests": reqs}))
    data = load_records([p])
    assert [r.start for r in data.records] == [0.5] and data.clock == "relative"


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"completed": 3}', "without 'requests'"),
        ("[1, 2]", "got a JSON list"),
        ("not json\n", "not a JSON line"),
        ('{"requests": [{"scheduled": 0, "ttft": -1}]}', "'ttft' must be a non-negative number"),
    ],
)
def test_records_bad_input(tmp_path, content, message):
    p = tmp_path / "bad.json"
    p.write_text(content)
    with pytest.raises(RecordsError, match=message):
        load_records([p])


class _Html(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.refs: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.refs += [v for k, v in attrs if k in ("src", "href") and v]


def test_cli_exports_agree(tmp_path):
    pytest.importorskip("pyarrow")
    results = synthetic_result(tmp_path / "r.json")
    out = tmp_path / "out"
    db = tmp_path / "c.db"
    rc = sla_main(
        [
            "audit",
            "--spec",
            str(spec_file(tmp_path)),
            "--results",
            str(results),
            "--out",
            str(out),
            "--export-db",
            str(db),
        ]
    )
    assert rc == 1
    doc = json.loads((out / "compliance.json").read_text())
    names = [c for c, _ in COLUMNS]
    rows = [[r[n] for n in names] for r in doc["rows"]]
    assert doc["verdict"] == "fail" and len(rows) == 4 * 4

    def norm(v, kind):
        if v in (None, ""):
            return None
        return {"int": int, "float": float, "str": str}[kind](v)

    kinds = [k for _, k in COLUMNS]
    with open(out / "compliance.csv", newline="") as f:
        r = list(csv.reader(f))
    assert r[0] == names
    assert [[norm(v, k) for v, k in zip(row, kinds)] for row in r[1:]] == rows

    import pyarrow.parquet as pq

    t = pq.read_table(out / "compliance.parquet")
    assert t.column_names == names
    assert [list(x.values()) for x in t.to_pylist()] == rows

    with sqlite3.connect(db) as conn:
        got = [list(x) for x in conn.execute(f"select {', '.join(names)} from sla_compliance")]
    assert got == rows

    html = (out / "report.html").read_text()
    p = _Html()
    p.feed(html)
    assert "svg" in p.tags and "table" in p.tags and not p.refs  # no external resource: readable offline
    assert "FAIL" in html and "ttft_p99" in html
    prom = {
        (s.name, s.labels.get("objective")): s.value
        for f in text_string_to_metric_families((out / "compliance.prom").read_text())
        for s in f.samples
    }
    assert prom[("distserve_sla_pass", None)] == 0 and prom[("distserve_sla_objective_pass", "ttft_p99")] == 0
    assert prom[("distserve_sla_windows_failed", "ttft_p99")] == 1
    assert prom[("distserve_sla_objective_pass", "tpot_p90")] == 1
    md = (out / "summary.md").read_text()
    assert "**FAIL**" in md and "| 20 | ttft_p99 |" in md

    # a second audit appends under its own audit_id
    assert (
        sla_main(
            [
                "audit",
                "--spec",
                str(spec_file(tmp_path)),
                "--results",
                str(results),
                "--out",
                str(out),
                "--export-db",
                f"sqlite:///{db}",
                "--formats",
                "json",
            ]
        )
        == 1
    )
    with sqlite3.connect(db) as conn:
        assert conn.execute("select count(distinct audit_id), count(*) from sla_compliance").fetchone() == (2, 32)


def test_exit_codes(tmp_path, capsys):
    results = synthetic_result(tmp_path / "r.json")
    # P90 of 100 samples per window has 10 above it: judged (a P99 of them would be insufficient data, exit 3)
    lenient = spec_file(tmp_path, objectives=[{"metric": "ttft", "percentile": 90, "threshold_ms": 1000}])
    assert (
        sla_main(
            [
                "audit",
                "--spec",
                str(lenient),
                "--results",
                str(results),
                "--out",
                str(tmp_path / "o"),
                "--formats",
                "json,csv,markdown,html",
            ]
        )
        == 0
    )
    assert json.loads((tmp_path / "o/compliance.json").read_text())["verdict"] == "pass"
    bad = tmp_path / "bad.yaml"
    bad.write_text("window_s: 10\nobjectivs: []\n")
    assert sla_main(["audit", "--spec", str(bad), "--results", str(results), "--out", str(tmp_path / "o")]) == 2
    assert "did you mean 'objectives'?" in capsys.readouterr().err
    assert (
        sla_main(
            ["audit", "--spec", str(lenient), "--results", str(tmp_path / "nope.json"), "--out", str(tmp_path / "o")]
        )
        == 2
    )
    assert (
        sla_main(
            [
                "audit",
                "--spec",
                str(lenient),
                "--results",
                str(results),
                "--out",
                str(tmp_path / "o"),
                "--export-db",
                "nosuchdb://x",
            ]
        )
        == 2
    )
    assert not any(p.name.startswith(".") for p in (tmp_path / "o").iterdir())  # no temporary files left


def test_distserve_sla_subcommand(tmp_path):
    """Through the real `distserve` entry point, in a subprocess: exit status 1 on a breach."""
    results = synthetic_result(tmp_path / "r.json")
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "distserve.server.cli",
            "sla",
            "audit",
            "--spec",
            str(spec_file(tmp_path)),
            "--results",
            str(results),
            "--out",
            str(tmp_path / "o"),
            "--formats",
            "json",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 1, p.stderr
    assert "verdict: fail" in p.stdout
    assert not math.isnan(json.loads((tmp_path / "o/compliance.json").read_text())["overall"][0]["observed"])
