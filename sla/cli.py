"""``distserve sla``: audit request records against an SLA spec and write compliance reports.

    distserve sla audit --spec configs/sla/default.yaml --results run.json --out sla-report/
    distserve sla audit --spec configs/sla/interactive.yaml --results router-journal.jsonl \\
        --out sla-report/ --export-db sqlite:///compliance.db

Exit status: 0 every objective passed in every window, 1 some failed, 2 bad input or an output
that cannot be written (unreadable spec or results, NaN/Infinity/negative latencies, unknown
format, missing optional dependency, full disk, unwritable folder: one sentence, no traceback),
3 none failed but some could not be judged: incomplete (the router's journal records lost lines
in the period: availability not judged) or insufficient data (too few samples for a percentile).

The reports are written into a temporary folder beside ``--out`` and renamed into place as a
whole, under a lock: a reader (or a second audit into the same folder) sees one audit's complete
set, never a mix of two or half of one.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import shutil
import sys
import tempfile
from pathlib import Path

from distserve.reports import RENDERERS, RendererUnavailable, render
from distserve.reports.sql import DEFAULT_TABLE, export_db
from distserve.sla.audit import audit
from distserve.sla.records import RecordsError, load_records
from distserve.sla.spec import SpecError, load_spec

EXIT_PASS, EXIT_FAIL, EXIT_BAD_INPUT, EXIT_NOT_JUDGED = 0, 1, 2, 3
DEFAULT_FORMATS = ("json", "csv", "parquet", "html", "markdown", "prom")


def _formats(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in RENDERERS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"--formats must be a comma list of {', '.join(RENDERERS)}; got {text!r}")
    return names


def _db_url(text: str) -> str:
    return text if "://" in text else f"sqlite:///{Path(text).resolve()}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="distserve sla", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser(
        "audit",
        help="judge distbench results / router journals against a spec",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Per objective and per window: observed percentile (HDR), samples, "
        "violations, error budget used, pass/fail; worst windows; overall verdict. "
        "Example: distserve sla audit --spec configs/sla/default.yaml "
        "--results run.json --out sla-report/",
    )
    a.add_argument("--spec", required=True, help="SLA spec YAML (configs/sla/*.yaml)")
    a.add_argument(
        "--results",
        required=True,
        nargs="+",
        help="distbench result files (JSON) and/or router request journals (JSON lines)",
    )
    a.add_argument(
        "--out", required=True, help="folder for compliance.{json,csv,parquet,prom}, report.html, summary.md"
    )
    a.add_argument(
        "--formats",
        type=_formats,
        default=None,
        help=f"renderers to run (default: {','.join(DEFAULT_FORMATS)}; parquet skipped "
        f"without pyarrow unless asked for)",
    )
    a.add_argument(
        "--export-db",
        type=_db_url,
        default=None,
        metavar="URL",
        help="also append the rows to a SQL table (SQLAlchemy URL, e.g. postgresql://u@host/db; "
        "a plain path means SQLite)",
    )
    a.add_argument("--table", default=DEFAULT_TABLE, help="table name for --export-db")
    return p


def cmd_audit(args) -> int:
    try:
        spec = load_spec(args.spec)
        data = load_records(args.results)
    except (SpecError, RecordsError) as e:
        return _bad(str(e))
    out = Path(args.out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    except OSError as e:
        return _bad(f"cannot create --out folder {out}: {e.strerror or e}")
    try:
        return _audit_into(args, spec, data, out, tmp)
    except OSError as e:  # full disk, read-only folder...: one sentence, nothing half-written left behind
        return _bad(f"cannot write the reports to {out}: {e.strerror or e}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _audit_into(args, spec, data, out: Path, tmp: Path) -> int:
    report = audit(spec, data).to_dict()
    formats = args.formats or list(DEFAULT_FORMATS)
    for name in formats:
        try:
            render(name, report, tmp)
        except RendererUnavailable as e:
            if args.formats:  # asked for explicitly
                return _bad(str(e))
            print(f"distserve sla: note: skipped {name}: {e}", file=sys.stderr)
    written = sorted(out / p.name for p in tmp.iterdir())
    _publish(tmp, out)
    if args.export_db:
        try:
            n = export_db(report, args.export_db, args.table)
        except RendererUnavailable as e:
            return _bad(str(e))
        except Exception as e:  # SQLAlchemy's errors (bad URL, driver missing, refused): one sentence
            return _bad(f"--export-db {args.export_db}: {type(e).__name__}: {str(e).splitlines()[0]}")
        print(f"appended {n} rows to table {args.table} at {args.export_db}")
    for line in overall_lines(report):
        print(line)
    if report["journal_gaps"]:
        print(
            f"incomplete: the journal records {len(report['journal_gaps'])} gap(s), "
            f"{report['dropped_records']} records known lost; availability not judged",
            file=sys.stderr,
        )
    nw = report["num_windows"]
    print(
        f"verdict: {report['verdict'].replace('_', ' ')} ({report['num_requests']} requests, "
        f"{nw} window{'' if nw == 1 else 's'}); wrote {', '.join(str(p) for p in written)}"
    )
    not_judged = {"incomplete": EXIT_NOT_JUDGED, "insufficient_data": EXIT_NOT_JUDGED}
    return {"pass": EXIT_PASS, **not_judged}.get(report["verdict"], EXIT_FAIL)


def _publish(tmp: Path, out: Path) -> None:
    """Put the reports of ``tmp`` in ``out`` as one set, under a lock beside it (concurrent audits).

    A folder that holds only audit reports (or none yet) is replaced by ``tmp`` as a whole (two
    renames). A folder that holds anything else too is the user's, and is never moved: each report
    is renamed into it, and reports of an earlier audit that this one did not write are removed."""
    ours = {filename for filename, _ in RENDERERS.values()}
    with open(out.parent / f".{out.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.is_dir() and any(p.name not in ours for p in out.iterdir()):
            made = {p.name for p in tmp.iterdir()}
            for p in tmp.iterdir():
                os.replace(p, out / p.name)
            for name in ours - made:
                (out / name).unlink(missing_ok=True)
            return
        old = None
        if out.exists():
            old = out.parent / f".{out.name}.old-{tmp.name}"
            os.rename(out, old)
        os.rename(tmp, out)
        tmp.mkdir()  # so the caller's cleanup has something to remove
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def overall_lines(report: dict) -> list[str]:
    """One line per objective, then cautions: thin tails (with the samples a verdict needs), partial windows."""
    width = max([len(o["objective"]) for o in report["overall"]] + [9])
    lines = []
    for o in report["overall"]:
        w = o["windows"]
        line = (
            f"{o['objective']:<{width}}  {o['status'].replace('_', ' '):<17}  windows failed {o['windows_failed']}/{w}"
        )
        if o.get("windows_insufficient"):
            line += (
                f"; {o['windows_insufficient']} window{'' if o['windows_insufficient'] == 1 else 's'} with too few "
                f"samples (P{o['percentile']:g} needs {o['samples_needed']:,} per window for 10 above it; "
                f"{o['samples']:,} in all)"
            )
        lines.append(line)
    spec_w = report["spec"]["window_s"]
    nw = report["num_windows"]
    if nw and report.get("covered_s", spec_w * nw) < 0.5 * spec_w * nw:
        share = 100 * report["covered_s"] / (spec_w * nw)
        lines.append(
            f"note: the records span {report['covered_s']:.1f} s of {nw} window{'' if nw == 1 else 's'} of "
            f"{spec_w:g} s ({share:.2g} % covered): the verdict speaks for that span only"
        )
    return lines


def _bad(sentence: str) -> int:
    print(f"distserve sla: error: {sentence}", file=sys.stderr)
    return EXIT_BAD_INPUT


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return {"audit": cmd_audit}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
