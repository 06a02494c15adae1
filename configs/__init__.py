"""The shipped configuration files, and how a command finds one.

The YAML here (``distserve_config.yaml``, ``demo_smollm2.yaml``, ``sla/*.yaml``, ``drills/*.yaml``,
``chaostoolkit/*.json``) is package data of the wheel, as are ``ci/release_gate.yaml`` and
``planner/profiles/*.json``; commands name them as in the checkout (``configs/sla/demo.yaml``) and
:func:`find` resolves such a name outside the checkout too.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path


def _shipped(rel: str) -> Path | None:
    """The installed copy of ``rel``: relative to the namespace (``ci/release_gate.yaml``,
    ``configs/sla/demo.yaml``), or to this folder (``sla/demo.yaml``)."""
    here = Path(str(resources.files(__name__)))  # a folder: the wheel is installed unzipped
    for base in (here.parent, here):
        p = base / rel
        if p.is_file():
            return p
    return None


def find(path: str | os.PathLike[str]) -> Path:
    """``path`` itself when it exists (absolute, or relative to the working folder, so a user's own file of
    the same name wins); else, for a relative name of a shipped file, the shipped copy; else ``path``
    unchanged, so the caller's error names what was typed."""
    p = Path(path)
    if p.exists() or p.is_absolute():
        return p
    rel = p.as_posix()
    while rel.startswith("./"):
        rel = rel[2:]
    if ".." in Path(rel).parts:
        return p
    return _shipped(rel) or p
