"""`--export-db` into a real PostgreSQL: a throwaway cluster (Debian's `postgresql` package) on a free
port in a temporary folder, started and stopped by this test. Skipped, with the reason, where the
server binaries or the psycopg driver are missing."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from distserve.sla.audit import COLUMNS
from distserve.sla.cli import main as sla_main

from .test_sla_audit import spec_file, synthetic_result


def _pg_bin() -> Path | None:
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    cands = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(cands[-1]).parent if cands else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def postgres():
    pytest.importorskip("psycopg", reason="psycopg (PostgreSQL driver) not installed: pip install 'psycopg[binary]'")
    bindir = _pg_bin()
    if bindir is None:
        pytest.skip("PostgreSQL server binaries not found (Debian: apt-get install postgresql)")
    as_user: list[str] = []
    # Not under pytest's tmp folder: that one is 0700 and the server may run as another user.
    root = Path(tempfile.mkdtemp(prefix="distserve-pg-"))
    if os.geteuid() == 0:  # postgres refuses to run as root: run it as the package's `postgres` user
        try:
            pw = pwd.getpwnam("postgres")
        except KeyError:
            shutil.rmtree(root)
            pytest.skip("running as root and no 'postgres' user to run the server as")
        os.chown(root, pw.pw_uid, pw.pw_gid)
        as_user = ["runuser", "-u", pw.pw_name, "--"]
    data, port = root / "data", _free_port()
    subprocess.run(
        [*as_user, str(bindir / "initdb"), "-D", str(data), "-U", "bi", "--auth=trust", "-E", "UTF8"],
        check=True,
        capture_output=True,
        timeout=120,
    )
    proc = subprocess.Popen(
        [
            *as_user,
            str(bindir / "postgres"),
            "-D",
            str(data),
            "-p",
            str(port),
            "-k",
            str(root),
            "-c",
            "listen_addresses=127.0.0.1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    import psycopg

    url = f"postgresql+psycopg://bi@127.0.0.1:{port}/postgres"
    deadline = time.monotonic() + 60
    while True:
        try:
            psycopg.connect(f"host=127.0.0.1 port={port} user=bi dbname=postgres", connect_timeout=2).close()
            break
        except psycopg.OperationalError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"postgres did not start: {proc.stderr.read().decode()[-2000:]}")
            time.sleep(0.2)
    yield url, port
    proc.terminate()  # SIGTERM: smart shutdown
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    shutil.rmtree(root, ignore_errors=True)


def test_export_db_postgresql_matches_json(tmp_path, postgres):
    import json

    import psycopg

    url, port = postgres
    out = tmp_path / "out"
    args = [
        "audit",
        "--spec",
        str(spec_file(tmp_path)),
        "--results",
        str(synthetic_result(tmp_path / "r.json")),
        "--out",
        str(out),
        "--formats",
        "json",
        "--export-db",
        url,
    ]
    assert sla_main(args) == 1
    assert sla_main(args) == 1  # appends a second audit
    names = [c for c, _ in COLUMNS]
    rows = json.loads((out / "compliance.json").read_text())["rows"]
    with psycopg.connect(f"host=127.0.0.1 port={port} user=bi dbname=postgres") as conn:
        audit_id = rows[0]["audit_id"]
        got = conn.execute(
            f"select {', '.join(names)} from sla_compliance where audit_id = %s order by window_index, objective",
            (audit_id,),
        ).fetchall()
        assert conn.execute("select count(distinct audit_id) from sla_compliance").fetchone()[0] == 2
        types = dict(
            conn.execute(
                "select column_name, data_type from information_schema.columns where table_name = 'sla_compliance'"
            ).fetchall()
        )
    want = sorted(([r[n] for n in names] for r in rows), key=lambda r: (r[2], r[6]))
    assert [list(g) for g in got] == want
    assert types["observed"] == "double precision" and types["samples"] == "bigint"
