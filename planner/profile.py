"""The profile file: measured step and transfer times of one model on one device (schema version 1).

A profile is data, not code: ``distserve profile`` writes one by measuring the real engine, the planner ships
others as files (``planner/profiles/NAME.json``, loaded by name; each built by a bench study from recorded
runs), and the simulator reads it through ``planner.latency``. Every
point says where it came from (``origin``: measured, interpolated, extrapolated, derived) so a plan made from
it can be judged. Loading validates everything once and raises ``ProfileError`` with one sentence.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = "distserve-profile"
VERSION = 1
ORIGINS = ("measured", "interpolated", "extrapolated", "derived")


class ProfileError(ValueError):
    """A profile file that cannot be used; the message is one sentence naming the field."""


@dataclass(frozen=True)
class PrefillPoint:
    batch: int  # prompts in the step
    tokens: int  # tokens per prompt
    ms: float  # one engine step
    origin: str = "measured"
    note: str = ""


@dataclass(frozen=True)
class DecodePoint:
    batch: int  # sequences in the step
    context: int  # tokens of context per sequence
    ms: float
    origin: str = "measured"
    note: str = ""


@dataclass(frozen=True)
class TransferPoint:
    bytes: int
    ms: float  # one pull, decode side, from PULL to DONE
    origin: str = "measured"
    note: str = ""


@dataclass(frozen=True)
class ThreadPoint:
    """One engine step with ``threads`` torch threads while ``neighbours`` other processes step beside it
    on the other cores; ``scale`` = its time / the same step with one thread and no neighbour."""

    phase: str  # prefill | decode
    threads: int
    neighbours: int
    scale: float
    origin: str = "measured"


@dataclass(frozen=True)
class SharePoint:
    """One engine step on ``share`` % of the GPU's SMs (a CUDA MPS client with that thread percentage):
    prefill ``batch`` x ``size`` prompt tokens, or decode ``batch`` sequences of ``size`` tokens of context.
    The planner scales a whole-GPU step by ms(share) / ms(100) of the same phase and shape
    (``planner/sm_shares.py``)."""

    phase: str  # prefill | decode
    share: int  # 1..100
    batch: int
    size: int
    ms: float
    origin: str = "measured"


@dataclass(frozen=True)
class Profile:
    device: str  # cpu | cuda (what `--device` a deployment passes)
    device_name: str  # e.g. "2-vCPU x86_64" or "NVIDIA H200"
    model: str  # what `--model` a deployment passes ("" = the built-in tiny model)
    kv_bytes_per_token: int
    devices_available: int  # cores on CPU (the unit the plan splits), GPUs on CUDA
    transport: str  # the transport the KV points measure
    prefill: tuple[PrefillPoint, ...]
    decode: tuple[DecodePoint, ...]
    kv_transfer: tuple[TransferPoint, ...]
    threads: tuple[ThreadPoint, ...] = ()
    overhead_ttft_ms: float = 0.0  # fixed serving-path cost on every TTFT (router, HTTP)
    handoff_ms: float = 0.0  # disaggregated: router -> decode worker -> first decode token, beyond the KV pull
    handoff_steps: int = 0  # ... and this many engine steps of a busy decode worker (handlers run between steps)
    admit_steps: int = 0  # a new request reaches a busy worker's scheduler after this many step ends (0, 1: next)
    # A prefill step's host side (eager launches, Python): at least ``prefill_floor_ms`` for one sequence, plus
    # ``prefill_per_seq_ms`` per further sequence; the step takes the larger of that and its GPU work (the fit
    # of ``prefill``). A chunked-prefill continuation (a prompt resumed over its cached context) adds
    # ``prefill_chunk_ms`` (0 = none of these three costs). Between steps a prefill worker's host (KV staging,
    # replies, the next requests' HTTP) takes ``prefill_post_ms`` per prompt the step finished.
    prefill_floor_ms: float = 0.0
    prefill_per_seq_ms: float = 0.0
    prefill_chunk_ms: float = 0.0
    prefill_post_ms: float = 0.0
    engine_thread: bool = False  # the step runs off the event loop: a finished prefill's reply does not wait a step
    cost_origins: dict[str, str] = field(default_factory=dict)  # e.g. prefill_chunk_ms -> "measured: ..."
    notes: tuple[str, ...] = field(default_factory=tuple)
    sm_shares: tuple[SharePoint, ...] = ()  # steps at SM shares (CUDA MPS); empty: no split can be planned
    # shares whose bf16 GEMMs came out wrong at start (``server.mps.gemm_self_check``): never measured, never planned
    sm_shares_wrong: tuple[int, ...] = ()

    def wrong_shares(self) -> frozenset[int]:
        """``sm_shares_wrong``, and for profiles written before that field, the shares their notes say were not
        measured because of wrong GEMMs (``planner/sm_shares.py``: "share N % not measured: a bf16 GEMM ...")."""
        noted = (re.match(r"share (\d+) % not measured: ", n) for n in self.notes)
        return frozenset(self.sm_shares_wrong) | {int(m.group(1)) for m in noted if m}

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        return {"schema": SCHEMA, "version": VERSION, **d}

    def save(self, path: str | Path) -> None:
        """Write atomically (temporary file + rename): a reader never sees half a profile."""
        path = Path(path)
        fd, tmp = tempfile.mkstemp(dir=path.parent or ".", prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(self.to_dict(), f, indent=1)
                f.write("\n")
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def _num(d: dict, key: str, where: str, *, positive: bool = True, integer: bool = False) -> Any:
    if key not in d:
        raise ProfileError(f"{where}: missing field {key!r}")
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise ProfileError(f"{where}.{key} must be a {'whole ' if integer else ''}number, got {v!r}")
    if v != v or (positive and v <= 0) or (not positive and v < 0):
        raise ProfileError(f"{where}.{key} must be {'> 0' if positive else '>= 0'}, got {v!r}")
    return v


def _origin(d: dict, where: str) -> str:
    o = d.get("origin", "measured")
    if o not in ORIGINS:
        raise ProfileError(f"{where}.origin must be one of {', '.join(ORIGINS)}, got {o!r}")
    return str(o)


def _points(data: dict, key: str, minimum: int) -> list[dict]:
    pts = data.get(key)
    if not isinstance(pts, list) or len(pts) < minimum:
        raise ProfileError(f"profile field {key!r} must be a list of at least {minimum} points")
    for i, p in enumerate(pts):
        if not isinstance(p, dict):
            raise ProfileError(f"{key}[{i}] must be an object")
    return pts


PREFILL_COSTS = ("prefill_floor_ms", "prefill_per_seq_ms", "prefill_chunk_ms", "prefill_post_ms")


def _flag(data: dict, key: str) -> bool:
    v = data.get(key, False)
    if not isinstance(v, bool):
        raise ProfileError(f"profile field {key!r} must be true or false, got {v!r}")
    return v


def _cost_origins(data: dict) -> dict[str, str]:
    """``cost_origins``: which measurement each scalar cost comes from, "<origin>: <source>"."""
    d = data.get("cost_origins", {})
    if not isinstance(d, dict):
        raise ProfileError("profile field 'cost_origins' must be an object")
    for k, v in d.items():
        if not isinstance(v, str) or v.split(":", 1)[0] not in ORIGINS:
            raise ProfileError(f"cost_origins.{k} must be a string starting with one of {', '.join(ORIGINS)}")
    return dict(d)


def from_dict(data: Any) -> Profile:
    if not isinstance(data, dict):
        raise ProfileError("a profile must be a JSON object")
    if data.get("schema") != SCHEMA:
        raise ProfileError(f"not a distserve profile (schema field is {data.get('schema')!r}, expected {SCHEMA!r})")
    if data.get("version") != VERSION:
        raise ProfileError(f"profile version {data.get('version')!r} is not supported (this build reads {VERSION})")
    for key in ("device", "device_name", "model", "transport"):
        if not isinstance(data.get(key), str):
            raise ProfileError(f"profile field {key!r} must be a string")
    prefill = tuple(
        PrefillPoint(
            _num(p, "batch", f"prefill[{i}]", integer=True),
            _num(p, "tokens", f"prefill[{i}]", integer=True),
            float(_num(p, "ms", f"prefill[{i}]")),
            _origin(p, f"prefill[{i}]"),
            str(p.get("note", "")),
        )
        for i, p in enumerate(_points(data, "prefill", 2))
    )
    decode = tuple(
        DecodePoint(
            _num(p, "batch", f"decode[{i}]", integer=True),
            _num(p, "context", f"decode[{i}]", integer=True),
            float(_num(p, "ms", f"decode[{i}]")),
            _origin(p, f"decode[{i}]"),
            str(p.get("note", "")),
        )
        for i, p in enumerate(_points(data, "decode", 2))
    )
    kv = tuple(
        TransferPoint(
            _num(p, "bytes", f"kv_transfer[{i}]", integer=True),
            float(_num(p, "ms", f"kv_transfer[{i}]")),
            _origin(p, f"kv_transfer[{i}]"),
            str(p.get("note", "")),
        )
        for i, p in enumerate(_points(data, "kv_transfer", 1))
    )
    threads = []
    for i, p in enumerate(data.get("threads") or []):
        if not isinstance(p, dict) or p.get("phase") not in ("prefill", "decode"):
            raise ProfileError(f"threads[{i}].phase must be prefill or decode")
        threads.append(
            ThreadPoint(
                p["phase"],
                _num(p, "threads", f"threads[{i}]", integer=True),
                _num(p, "neighbours", f"threads[{i}]", positive=False, integer=True),
                float(_num(p, "scale", f"threads[{i}]")),
                _origin(p, f"threads[{i}]"),
            )
        )
    shares = []
    for i, p in enumerate(data.get("sm_shares") or []):
        if not isinstance(p, dict) or p.get("phase") not in ("prefill", "decode"):
            raise ProfileError(f"sm_shares[{i}].phase must be prefill or decode")
        share = _num(p, "share", f"sm_shares[{i}]", integer=True)
        if share > 100:
            raise ProfileError(f"sm_shares[{i}].share must be a percentage in 1..100, got {share}")
        shares.append(
            SharePoint(
                p["phase"],
                share,
                _num(p, "batch", f"sm_shares[{i}]", integer=True),
                _num(p, "size", f"sm_shares[{i}]", integer=True),
                float(_num(p, "ms", f"sm_shares[{i}]")),
                _origin(p, f"sm_shares[{i}]"),
            )
        )
    wrong = data.get("sm_shares_wrong") or []
    if not isinstance(wrong, list) or not all(isinstance(x, int) and 1 <= x <= 100 for x in wrong):
        raise ProfileError(f"profile field 'sm_shares_wrong' must be a list of percentages in 1..100, got {wrong!r}")
    notes = data.get("notes", [])
    if not isinstance(notes, list) or not all(isinstance(n, str) for n in notes):
        raise ProfileError("profile field 'notes' must be a list of strings")
    return Profile(
        device=data["device"],
        device_name=data["device_name"],
        model=data["model"],
        kv_bytes_per_token=_num(data, "kv_bytes_per_token", "profile", integer=True),
        devices_available=_num(data, "devices_available", "profile", integer=True),
        transport=data["transport"],
        prefill=prefill,
        decode=decode,
        kv_transfer=kv,
        threads=tuple(threads),
        overhead_ttft_ms=float(_num(data, "overhead_ttft_ms", "profile", positive=False))
        if "overhead_ttft_ms" in data
        else 0.0,
        handoff_ms=float(_num(data, "handoff_ms", "profile", positive=False)) if "handoff_ms" in data else 0.0,
        handoff_steps=_num(data, "handoff_steps", "profile", positive=False, integer=True)
        if "handoff_steps" in data
        else 0,
        admit_steps=_num(data, "admit_steps", "profile", positive=False, integer=True) if "admit_steps" in data else 0,
        **{k: float(_num(data, k, "profile", positive=False)) if k in data else 0.0 for k in PREFILL_COSTS},
        engine_thread=_flag(data, "engine_thread"),
        cost_origins=_cost_origins(data),
        notes=tuple(notes),
        sm_shares=tuple(shares),
        sm_shares_wrong=tuple(sorted(set(wrong))),
    )


PROFILES = Path(__file__).resolve().parent / "profiles"  # the shipped profiles (package data)


def shipped() -> list[str]:
    """Names of the profiles shipped with the planner (``planner/profiles/NAME.json``)."""
    return sorted(p.stem for p in PROFILES.glob("*.json"))


def resolve(name_or_path: str | Path) -> Path:
    """A shipped profile's name (``h200-llama2-7b``) or a path to a profile file."""
    s = str(name_or_path)
    if "/" not in s and not s.endswith(".json") and (PROFILES / f"{s}.json").is_file():
        return PROFILES / f"{s}.json"
    return Path(s)


def load(path: str | Path) -> Profile:
    """Read and validate a profile: a shipped profile's name or a file; ``ProfileError`` (one sentence) when it
    cannot be used."""
    p = resolve(path)
    if not p.exists() and "/" not in str(path) and not str(path).endswith(".json"):
        names = ", ".join(shipped()) or "none"
        raise ProfileError(f"no profile {str(path)!r}: neither a file nor a shipped profile (shipped: {names})")
    try:
        text = p.read_text()
    except OSError as e:
        raise ProfileError(f"cannot read profile {p}: {e.strerror or e}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ProfileError(f"profile {p} is not JSON ({e.msg} at line {e.lineno})") from None
    return from_dict(data)
