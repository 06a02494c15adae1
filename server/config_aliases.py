"""Keys of the source article's ``distserve_config.yaml`` that this project spells differently.

Each old key is accepted, moved to its new place, and named in one warning, so the article's file loads
as written and says what to change. A key given in both spellings is refused (which one was meant?).
docs/FROM_THE_ARTICLE.md maps every key of the article.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

log = logging.getLogger("distserve.server.config")

# (old section, old key) -> (new section, new key); values carry over unchanged (both in MB here)
ALIASES: dict[tuple[str, str], tuple[str, str]] = {
    ("rdma", "zero_copy_threshold"): ("kv_transfer", "zero_copy_threshold_mb"),
}
_OLD_SECTIONS = {old for old, _ in ALIASES}


def apply_aliases(raw: Any, where: str = "config") -> tuple[Any, list[str]]:
    """``raw`` (a loaded YAML mapping) with the old keys moved to their new place, and one warning per move.

    Returns ``raw`` untouched when it is not a mapping or names no old key (the validator reports those)."""
    if not isinstance(raw, Mapping) or not any(isinstance(raw.get(s), Mapping) for s in _OLD_SECTIONS):
        return raw, []
    out: dict[str, Any] = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in raw.items()}
    warnings = []
    for (old_sec, old_key), (new_sec, new_key) in ALIASES.items():
        section = out.get(old_sec)
        if not isinstance(section, dict) or old_key not in section:
            continue
        value = section.pop(old_key)
        target = out.setdefault(new_sec, {})
        if target is None:
            target = out[new_sec] = {}
        if not isinstance(target, dict):
            continue  # the validator says the section must be a mapping
        if new_key in target and target[new_key] != value:
            from distserve.server.config import ConfigError

            raise ConfigError(
                f"{where}: {old_sec}.{old_key} (the article's name) and {new_sec}.{new_key} are both given "
                "and differ; keep only the second"
            )
        target[new_key] = value
        warnings.append(f"{where}: {old_sec}.{old_key} is spelled {new_sec}.{new_key} here; read it as that")
    for old_sec in _OLD_SECTIONS:
        if out.get(old_sec) == {}:
            del out[old_sec]
    for w in warnings:
        log.warning("%s", w)
    return out, warnings
