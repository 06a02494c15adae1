"""Keys that moved to the section of the role that reads them.

A config section is named by a role and holds what that role reads. ``decode.sampling_strategy`` and
``decode.top_p`` are the defaults the *router* gives a request that leaves ``temperature``/``top_p`` out
(``server/router/sampling_defaults.py``); no decode worker reads them, so they live in ``router``. The old
spelling (the source article's) is accepted, moved, and named in one warning with its new key; a key given
in both places with different values is refused (which one was meant?).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

log = logging.getLogger("distserve.server.config")

# (old section, key) -> (new section, key): the role that reads the key
MOVED: dict[tuple[str, str], tuple[str, str]] = {
    ("decode", "sampling_strategy"): ("router", "sampling_strategy"),
    ("decode", "top_p"): ("router", "top_p"),
}


def apply_moves(raw: Any, where: str = "config") -> tuple[Any, list[str]]:
    """``raw`` (a config mapping: a YAML file's, or overrides) with moved keys in their new section, and the
    one warning per key moved (also logged). ``raw`` is returned untouched when nothing moves."""
    if not isinstance(raw, Mapping) or not any(
        isinstance(raw.get(sec), Mapping) and key in raw[sec] for sec, key in MOVED
    ):
        return raw, []
    out: dict[str, Any] = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in raw.items()}
    warnings = []
    for (old_sec, key), (new_sec, new_key) in MOVED.items():
        section = out.get(old_sec)
        if not isinstance(section, dict) or key not in section:
            continue
        value = section.pop(key)
        target = out.get(new_sec)
        if target is None:
            target = out[new_sec] = {}
        if not isinstance(target, dict):
            continue  # the validator says the section must be a mapping
        if new_key in target and target[new_key] != value:
            from distserve.server.config import ConfigError

            both = f"{old_sec}.{key} and {new_sec}.{new_key}"
            raise ConfigError(f"{where}: {both} are both given and differ; keep only {new_sec}.{new_key}")
        target[new_key] = value
        warnings.append(f"{where}: {old_sec}.{key} is read by the {new_sec}: write it as {new_sec}.{new_key}")
    for w in warnings:
        log.warning("%s", w)
    return out, warnings
