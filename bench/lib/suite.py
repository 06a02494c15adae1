"""The registry (``bench/suite.yaml``): its studies, validated once on load; ``SuiteError`` names the study and
the field of a bad entry."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SUITE = REPO / "bench" / "suite.yaml"
SUBJECTS = ("engine", "kernels", "kv_transfer", "serving", "peers", "resilience", "loadgen", "planner")
DEVICES = ("cpu", "h200", "h200-x2", "h200-x4", "h200-x8")
STEP_KINDS = ("module", "script", "pytest")


class SuiteError(ValueError):
    """A bad registry entry, in one sentence naming the study and the field."""


@dataclass(frozen=True)
class Step:
    name: str
    kind: str  # module | script | pytest
    target: str  # the module, the script path, or "" for pytest
    args: tuple[str, ...]
    timeout_s: float | None = None

    def argv(self, python: str, out: str) -> list[str]:
        args = [a.replace("{out}", out) for a in self.args]
        if self.kind == "module":
            return [python, "-m", self.target, *args]
        if self.kind == "pytest":
            return [python, "-m", "pytest", *args]
        return ["bash", self.target, *args]


@dataclass(frozen=True)
class Study:
    id: str
    subject: str
    device: str
    measures: str
    steps: tuple[Step, ...]
    variants: dict[str, tuple[str, ...]] = field(default_factory=dict)
    baselines: tuple[str, ...] = ()
    records: tuple[str, ...] = ()
    reports: tuple[str, ...] = ()
    modules: tuple[str, ...] = ()  # the Python modules a script study runs

    def with_variant(self, name: str | None) -> tuple[Step, ...]:
        if name is None:
            return self.steps
        if name not in self.variants:
            known = ", ".join(self.variants) or "none"
            raise SuiteError(f"study {self.id} has no variant {name!r} (variants: {known})")
        (only,) = self.steps  # variants exist only on one-step studies (checked on load)
        return (Step(only.name, only.kind, only.target, self.variants[name], only.timeout_s),)


@dataclass(frozen=True)
class Suite:
    studies: dict[str, Study]
    helpers: tuple[str, ...]

    def get(self, study_id: str) -> Study:
        if study_id not in self.studies:
            raise SuiteError(f"no study {study_id!r} in bench/suite.yaml (python -m bench list)")
        return self.studies[study_id]


def module_path(module: str, repo: Path = REPO) -> Path:
    return repo / (module.replace(".", os.sep) + ".py")


def _strs(v: Any, where: str) -> tuple[str, ...]:
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise SuiteError(f"{where} must be a list of strings")
    return tuple(v)


def _step(d: Any, where: str, repo: Path) -> Step:
    if not isinstance(d, dict):
        raise SuiteError(f"{where} must be a mapping")
    kinds = [k for k in STEP_KINDS if k in d]
    if len(kinds) != 1:
        raise SuiteError(f"{where} needs exactly one of {', '.join(STEP_KINDS)}")
    kind = kinds[0]
    if kind == "pytest":
        target, args = "", _strs(d["pytest"], f"{where}.pytest")
    else:
        target = d[kind]
        if not isinstance(target, str):
            raise SuiteError(f"{where}.{kind} must be a string")
        path = module_path(target, repo) if kind == "module" else repo / target
        if not path.is_file():
            raise SuiteError(f"{where}.{kind}: no file {path.relative_to(repo)}")
        args = _strs(d.get("args", []), f"{where}.args")
    t = d.get("timeout_s")
    if t is not None and (not isinstance(t, int | float) or t <= 0):
        raise SuiteError(f"{where}.timeout_s must be a positive number")
    unknown = set(d) - {*STEP_KINDS, "args", "timeout_s", "name"}
    if unknown:
        raise SuiteError(f"{where}: unknown field {sorted(unknown)[0]!r}")
    name = d.get("name") or (target.rsplit(".", 1)[-1] if kind == "module" else Path(target).stem or "pytest")
    return Step(str(name), kind, target, args, float(t) if t is not None else None)


STUDY_FIELDS = {"id", "subject", "device", "measures", "module", "script", "args", "steps", "variants"} | {
    "baselines",
    "records",
    "reports",
    "modules",
}


def _study(d: Any, i: int, repo: Path) -> Study:
    if not isinstance(d, dict) or not isinstance(d.get("id"), str):
        raise SuiteError(f"studies[{i}] needs an id (a string)")
    sid = d["id"]
    w = f"study {sid}"
    unknown = set(d) - STUDY_FIELDS
    if unknown:
        raise SuiteError(f"{w}: unknown field {sorted(unknown)[0]!r}")
    if d.get("subject") not in SUBJECTS:
        raise SuiteError(f"{w}: subject must be one of {', '.join(SUBJECTS)}, got {d.get('subject')!r}")
    if d.get("device") not in DEVICES:
        raise SuiteError(f"{w}: device must be one of {', '.join(DEVICES)}, got {d.get('device')!r}")
    if not isinstance(d.get("measures"), str) or not d["measures"].strip():
        raise SuiteError(f"{w}: measures must say what it measures")
    if "steps" in d:
        if "module" in d or "script" in d or not isinstance(d["steps"], list) or not d["steps"]:
            raise SuiteError(f"{w}: steps must be a non-empty list, and then no module or script")
        steps = tuple(_step(s, f"{w}.steps[{j}]", repo) for j, s in enumerate(d["steps"]))
    else:
        one = {k: d[k] for k in ("module", "script", "args") if k in d}
        steps = (_step(one, w, repo),)
    variants_raw = d.get("variants", {})
    if not isinstance(variants_raw, dict):
        raise SuiteError(f"{w}.variants must be a mapping of name to argument list")
    if variants_raw and len(steps) != 1:
        raise SuiteError(f"{w}.variants: only a one-step study has variants")
    variants = {str(k): _strs(v, f"{w}.variants.{k}") for k, v in variants_raw.items()}
    baselines = _strs(d.get("baselines", []), f"{w}.baselines")
    for b in baselines:
        if not (repo / b).is_file():
            raise SuiteError(f"{w}.baselines: no file {b}")
    records = _strs(d.get("records", []), f"{w}.records")
    for r in records:
        if not (repo / r).exists():
            raise SuiteError(f"{w}.records: no {r}")
    reports = _strs(d.get("reports", []), f"{w}.reports")
    modules = _strs(d.get("modules", []), f"{w}.modules")
    for key, mods in (("reports", reports), ("modules", modules)):
        for m in mods:
            if not module_path(m, repo).is_file():
                raise SuiteError(f"{w}.{key}: no module {m}")
    return Study(
        sid, d["subject"], d["device"], d["measures"].strip(), steps, variants, baselines, records, reports, modules
    )


def parse(data: Any, repo: Path = REPO) -> Suite:
    if not isinstance(data, dict) or data.get("version") != 1:
        raise SuiteError("bench/suite.yaml must be a mapping with version: 1")
    raw = data.get("studies")
    if not isinstance(raw, list) or not raw:
        raise SuiteError("bench/suite.yaml: studies must be a non-empty list")
    studies: dict[str, Study] = {}
    for i, d in enumerate(raw):
        s = _study(d, i, repo)
        if s.id in studies:
            raise SuiteError(f"study {s.id} is listed twice")
        studies[s.id] = s
    helpers = _strs(data.get("helpers", []), "helpers")
    for m in helpers:
        if not module_path(m, repo).is_file():
            raise SuiteError(f"helpers: no module {m}")
    return Suite(studies, helpers)


def load(path: Path = SUITE) -> Suite:
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise SuiteError(f"cannot read {path}: {e}") from None
    return parse(data, path.resolve().parents[1])
