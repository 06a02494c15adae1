"""Renderers of compliance reports, registered by name.

Each renderer takes the audit's plain-data report (``sla.audit.AuditReport.to_dict()``:
``rows`` of the columns listed in ``columns``, plus ``overall``, ``worst_windows``,
``verdict``, ``spec``) and writes one file atomically (tmp + rename: a reader never sees
half a report). They know nothing about SLAs beyond that shape.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from distserve.distbench.atomic import atomic_write

__all__ = ["RENDERERS", "RendererUnavailable", "atomic_write", "render"]


class RendererUnavailable(RuntimeError):
    """A renderer's optional dependency is not installed (e.g. pyarrow for parquet)."""


def _json(report: dict, path: Path) -> None:
    from distserve.reports.tabular import write_json

    write_json(report, path)


def _csv(report: dict, path: Path) -> None:
    from distserve.reports.tabular import write_csv

    write_csv(report, path)


def _markdown(report: dict, path: Path) -> None:
    from distserve.reports.tabular import write_markdown

    write_markdown(report, path)


def _parquet(report: dict, path: Path) -> None:
    from distserve.reports.parquet import write_parquet

    write_parquet(report, path)


def _html(report: dict, path: Path) -> None:
    from distserve.reports.html import write_html

    write_html(report, path)


def _prom(report: dict, path: Path) -> None:
    from distserve.reports.prom import write_prom

    write_prom(report, path)


# name -> (file name in the output folder, writer)
RENDERERS: dict[str, tuple[str, Callable[[dict, Path], None]]] = {
    "json": ("compliance.json", _json),
    "csv": ("compliance.csv", _csv),
    "parquet": ("compliance.parquet", _parquet),
    "html": ("report.html", _html),
    "markdown": ("summary.md", _markdown),
    "prom": ("compliance.prom", _prom),
}


def render(name: str, report: dict, out_dir: Path) -> Path:
    """Write the report with renderer ``name`` into ``out_dir``; returns the file's path."""
    filename, write = RENDERERS[name]
    path = Path(out_dir) / filename
    write(report, path)
    return path
