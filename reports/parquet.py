"""Parquet renderer (pyarrow, the optional ``reports`` extra): the rows with typed columns."""

from __future__ import annotations

import io
from pathlib import Path

from distserve.distbench.atomic import atomic_write

_TYPES = {"int": "int64", "float": "float64", "str": "string"}


def write_parquet(report: dict, path: Path) -> None:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        from distserve.reports import RendererUnavailable

        raise RendererUnavailable(
            "parquet needs pyarrow: pip install -e '.[reports]' in a distserve checkout "
            "('distserve[reports]' where distserve comes from an index)"
        ) from None
    schema = pa.schema([(name, getattr(pa, _TYPES[kind])()) for name, kind in report["columns"]])
    table = pa.Table.from_pylist(report["rows"], schema=schema)
    buf = io.BytesIO()
    pq.write_table(table, buf)
    atomic_write(path, buf.getvalue())
