"""SLA specs: what a contract promises, typed, frozen and validated once.

A spec is a YAML file (``configs/sla/*.yaml``)::

    name: default
    window_s: 3600            # the SLA is judged per window of this many seconds
    availability: 0.999       # share of requests that must succeed, per window
    objectives:
      - metric: ttft          # ttft | tpot | itl | e2e
        percentile: 99.9      # 0 < p < 100
        threshold_ms: 300     # the percentile must be <= this

Unknown keys fail with the closest valid one ("did you mean ..."), bad values
name their key, so a typo never silently weakens a contract.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from distserve.configs import find as find_config

__all__ = ["METRICS", "Objective", "SlaSpec", "SpecError", "load_spec"]

METRICS = ("ttft", "tpot", "itl", "e2e")


class SpecError(ValueError):
    """An SLA spec file or value is invalid; the message names the key."""


def _check_keys(where: str, d: Mapping[str, Any], valid: tuple[str, ...]) -> None:
    for k in d:
        if k not in valid:
            close = difflib.get_close_matches(str(k), valid, n=1)
            key = f"{where}.{k}" if where else str(k)
            hint = (
                f"did you mean {(where + '.' if where else '') + close[0]!r}?"
                if close
                else f"valid keys: {', '.join(valid)}"
            )
            raise SpecError(f"unknown key {key!r}; {hint}")


def _number(key: str, v: Any, lo: float, hi: float | None = None, lo_open: bool = True, hi_open: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise SpecError(f"{key!r} must be a number, got {v!r}")
    ok = (v > lo if lo_open else v >= lo) and (hi is None or (v < hi if hi_open else v <= hi))
    if not ok:
        left = "(" if lo_open else "["
        rng = f"> {lo:g}" if hi is None else f"in {left}{lo:g}, {hi:g}{')' if hi_open else ']'}"
        raise SpecError(f"{key!r} must be {rng}, got {v!r}")
    return float(v)


@dataclass(frozen=True)
class Objective:
    """``percentile`` of ``metric`` per window must be <= ``threshold_ms``."""

    metric: str
    percentile: float
    threshold_ms: float

    @property
    def name(self) -> str:
        """Stable id used as a column value: ``ttft_p99.9``."""
        return f"{self.metric}_p{self.percentile:g}"

    @property
    def allowed_share(self) -> float:
        """Share of samples that may exceed the threshold: the objective's error budget."""
        return 1.0 - self.percentile / 100.0

    @classmethod
    def from_dict(cls, where: str, d: Any) -> Objective:
        if not isinstance(d, Mapping):
            raise SpecError(f"{where!r} must be a mapping with metric, percentile, threshold_ms; got {d!r}")
        valid = ("metric", "percentile", "threshold_ms")
        _check_keys(where, d, valid)
        for k in valid:
            if k not in d:
                raise SpecError(f"'{where}.{k}' is required")
        metric = d["metric"]
        if metric not in METRICS:
            raise SpecError(f"'{where}.metric' must be one of {', '.join(METRICS)}; got {metric!r}")
        return cls(
            metric=metric,
            percentile=_number(f"{where}.percentile", d["percentile"], 0.0, 100.0, hi_open=True),
            threshold_ms=_number(f"{where}.threshold_ms", d["threshold_ms"], 0.0),
        )


@dataclass(frozen=True)
class SlaSpec:
    name: str
    window_s: float
    availability: float | None
    objectives: tuple[Objective, ...]

    _KEYS = ("name", "window_s", "availability", "objectives")

    @classmethod
    def from_dict(cls, d: Any, default_name: str = "sla") -> SlaSpec:
        if not isinstance(d, Mapping):
            raise SpecError(f"the spec must be a mapping of keys to values, got {type(d).__name__}")
        _check_keys("", d, cls._KEYS)
        name = d.get("name", default_name)
        if not isinstance(name, str) or not name:
            raise SpecError(f"'name' must be a non-empty string, got {name!r}")
        if "window_s" not in d:
            raise SpecError("'window_s' is required (the length of one SLA window, seconds)")
        window_s = _number("window_s", d["window_s"], 0.0)
        avail = d.get("availability")
        if avail is not None:
            avail = _number("availability", avail, 0.0, 1.0)
        objs = d.get("objectives") or []
        if not isinstance(objs, list):
            raise SpecError(f"'objectives' must be a list, got {type(objs).__name__}")
        objectives = tuple(Objective.from_dict(f"objectives[{i}]", o) for i, o in enumerate(objs))
        if not objectives and avail is None:
            raise SpecError("the spec promises nothing: give 'objectives' and/or 'availability'")
        names = [o.name for o in objectives]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup:
            raise SpecError(f"'objectives' lists {dup} twice")
        return cls(name=name, window_s=window_s, availability=avail, objectives=objectives)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "window_s": self.window_s,
            "availability": self.availability,
            "objectives": [
                {"metric": o.metric, "percentile": o.percentile, "threshold_ms": o.threshold_ms}
                for o in self.objectives
            ],
        }


def load_spec(path: str | Path) -> SlaSpec:
    """Read and validate a spec file; every error names the file and the key."""
    p = Path(path)
    try:
        text = find_config(p).read_text(encoding="utf-8")
    except OSError as e:
        raise SpecError(f"{p}: cannot read spec: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise SpecError(f"{p}: invalid YAML: {getattr(e, 'problem', None) or e}") from None
    try:
        return SlaSpec.from_dict(data, default_name=p.stem)
    except SpecError as e:
        raise SpecError(f"{p}: {e}") from None
