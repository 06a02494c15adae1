"""Append compliance rows to a SQL table through SQLAlchemy (SQLite, PostgreSQL, ...).

The table (default ``sla_compliance``) is created when missing with the report's
columns; every audit appends its rows under its own ``audit_id``, so a BI tool can
chart compliance over time. The insert is one transaction: all rows or none.
"""

from __future__ import annotations

DEFAULT_TABLE = "sla_compliance"


def export_db(report: dict, url: str, table: str = DEFAULT_TABLE) -> int:
    """Append ``report["rows"]`` to ``table`` at ``url``; returns the number of rows written."""
    try:
        import sqlalchemy as sa
    except ImportError:
        from distserve.reports import RendererUnavailable

        raise RendererUnavailable(
            "--export-db needs SQLAlchemy: pip install -e '.[reports]' in a distserve checkout "
            "('distserve[reports]' where distserve comes from an index)"
        ) from None
    types: dict[str, sa.types.TypeEngine] = {"int": sa.BigInteger(), "float": sa.Float(precision=53), "str": sa.Text()}
    engine = sa.create_engine(url)
    try:
        meta = sa.MetaData()
        t = sa.Table(table, meta, *(sa.Column(name, types[kind]) for name, kind in report["columns"]))
        with engine.begin() as conn:
            meta.create_all(conn, checkfirst=True)
            if report["rows"]:
                conn.execute(t.insert(), report["rows"])
    finally:
        engine.dispose()
    return len(report["rows"])
