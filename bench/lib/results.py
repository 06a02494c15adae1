"""The suite's one results writer: every JSON a study writes carries where it came from.

``write_result(path, doc)`` adds ``doc["provenance"]``: the commit (``git rev-parse HEAD``, ``+dirty`` when the
work tree has changes; ``unknown`` outside a checkout, e.g. the device's copy), the hardware (the GPU's name and
count when torch sees CUDA, else the CPU model and core count), the date (UTC, ISO 8601) and the command line.
The write is atomic (``distbench.atomic``); a ``.gz`` or ``.xz`` path is compressed.
"""

from __future__ import annotations

import datetime as _dt
import gzip
import json
import lzma
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from distserve.distbench.atomic import atomic_write

REPO = Path(__file__).resolve().parents[2]


def commit(repo: Path = REPO) -> str:
    """HEAD of the checkout (``+dirty`` with uncommitted changes), or ``unknown``."""
    try:
        head = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("DISTSERVE_COMMIT", "unknown")
    return head + ("+dirty" if dirty else "")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware() -> dict[str, Any]:
    """The GPU(s) when the study imported torch and it sees CUDA, and always the CPU (model, usable cores)."""
    out: dict[str, Any] = {"cpu": cpu_model(), "cpu_cores": len(os.sched_getaffinity(0))}
    torch = sys.modules.get("torch")  # a GPU study has imported it; a CPU one need not pay the import
    if torch is not None and torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
        out["gpus"] = torch.cuda.device_count()
    return out


def provenance(argv: list[str] | None = None) -> dict[str, Any]:
    return {
        "commit": commit(),
        "hardware": hardware(),
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "command": shlex.join([Path(sys.executable).name, *(sys.argv if argv is None else argv)]),
    }


def _plain(o: Any) -> Any:
    """What json cannot write: numbers (numpy, torch scalars) as floats, anything else as its text."""
    try:
        return float(o)
    except (TypeError, ValueError):
        return str(o)


def dumps(doc: dict[str, Any], argv: list[str] | None = None, compact: bool = False) -> str:
    """``doc`` with its provenance, as the JSON text ``write_result`` writes."""
    full = {**doc, "provenance": provenance(argv)}
    if compact:
        return json.dumps(full, separators=(",", ":"), default=_plain)
    return json.dumps(full, indent=1, default=_plain) + "\n"


def write_result(path: str | Path, doc: dict[str, Any], argv: list[str] | None = None) -> Path:
    """Write ``doc`` (a JSON object) with its provenance to ``path`` atomically; the path written."""
    path = Path(path)
    data = dumps(doc, argv, compact=path.suffix in (".gz", ".xz")).encode()
    if path.suffix == ".gz":
        data = gzip.compress(data, 6)
    elif path.suffix == ".xz":
        data = lzma.compress(data)
    return atomic_write(path, data)


def read_result(path: str | Path) -> Any:
    """A result written by ``write_result`` (or any JSON file; ``.gz``/``.xz`` decompressed)."""
    path = Path(path)
    raw = path.read_bytes()
    if path.suffix == ".gz":
        raw = gzip.decompress(raw)
    elif path.suffix == ".xz":
        raw = lzma.decompress(raw)
    return json.loads(raw)
