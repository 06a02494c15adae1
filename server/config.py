"""Typed, frozen server configuration, validated once at construction.

Every section is a frozen dataclass whose fields carry their own spec (kind,
range, choices) in ``field(metadata=...)``: that is the one table per section
that both the defaults and the validation come from.  A bad value fails when
the object is built, with the full dotted key in the message, so nothing
downstream re-checks configuration.

    cfg = load_config("configs/distserve_config.yaml",
                      overrides={"router": {"top_p": 0.9}})
"""

from __future__ import annotations

import difflib
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlparse

import yaml

from distserve.configs import find as find_config

__all__ = [
    "BreakerConfig",
    "CacheConfig",
    "ConfigError",
    "DecodeConfig",
    "DistServeConfig",
    "KVTransferConfig",
    "OutlierConfig",
    "PrefillConfig",
    "RayConfig",
    "RouterConfig",
    "load_config",
    "role_dtype",
]


class ConfigError(ValueError):
    """A configuration file, mapping or value is invalid."""


# --------------------------------------------------------------------------- specs


@dataclass(frozen=True)
class _Spec:
    kind: str  # int | float | bool | str | enum | url_list | resources
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    choices: tuple[str, ...] = ()
    nullable: bool = False
    pow2: bool = False


def _opt(default: Any, kind: str, **spec: Any) -> Any:
    """A leaf field: its default and how to validate it."""
    return field(default=default, metadata={"spec": _Spec(kind, **spec)})


def _sub(cls: type) -> Any:
    """A nested section field."""
    return field(default_factory=cls, metadata={"section": cls})


_KIND_NAMES = {
    "int": "an integer",
    "float": "a number",
    "bool": "a boolean (true/false)",
    "str": "a string",
    "url_list": "a list of strings",
    "resources": "a mapping of resource names to amounts >= 0",
}

_MS_MAX = 3_600_000  # one hour, in milliseconds
_DTYPE_CHOICES = ("auto", "float32", "float16", "bfloat16")
_KV_DTYPE_CHOICES = ("auto", "bf16", "fp8_e4m3")


def _num(x: float | None) -> str:
    if x is None:
        return "unbounded"
    if isinstance(x, int) and x.bit_length() > 64:  # YAML reads 400 digits as an int: no float holds it
        return f"an integer of {x.bit_length()} bits"
    return str(int(x)) if float(x).is_integer() else repr(x)


def _describe(v: Any) -> str:
    if v is None:
        return "null"
    text = repr(v)
    return f"{type(v).__name__} {text if len(text) <= 80 else text[:60] + f'... ({len(text)} chars)'}"


def _yaml_number_hint(s: _Spec, v: Any) -> str:
    """YAML 1.1 (PyYAML) reads ``1e-3`` and ``1e3`` as strings: say how to write them."""
    if s.kind not in ("int", "float") or not isinstance(v, str) or "e" not in v.lower():
        return ""
    try:
        x = float(v)
    except ValueError:
        return ""
    mantissa, _, exp = v.lower().partition("e")
    written = f"{mantissa if '.' in mantissa else mantissa + '.0'}e{exp}"
    if s.kind == "int" and x.is_integer() and abs(x) < 1e18:
        written = str(int(x))
    return f" (YAML reads a number in e-notation without a dot as a string: write {written})"


def _range_text(s: _Spec) -> str:
    if s.hi is None:
        return f"{'>' if s.lo_open else '>='} {_num(s.lo)}"
    return f"in {'(' if s.lo_open else '['}{_num(s.lo)}, {_num(s.hi)}{')' if s.hi_open else ']'}"


def _validate(key: str, s: _Spec, v: Any) -> Any:
    """Return ``v`` normalised (int/float/tuple) or raise ConfigError."""
    if v is None and s.nullable:
        return None
    if s.kind == "resources":  # Ray resources, e.g. {prefill_node: 1, GPU: 1}: kept as sorted (name, amount) pairs
        items = tuple(v.items()) if isinstance(v, Mapping) else v if isinstance(v, tuple) else ()
        ok = isinstance(v, Mapping | tuple) and all(
            isinstance(kv, tuple)
            and len(kv) == 2
            and isinstance(kv[0], str)
            and kv[0]
            and isinstance(kv[1], int | float)
            and not isinstance(kv[1], bool)
            and kv[1] >= 0
            for kv in items
        )
        if not ok:
            raise ConfigError(f"{key!r} must be {_KIND_NAMES[s.kind]}, got {_describe(v)}")
        return tuple(sorted((k, float(n)) for k, n in items))
    if s.kind == "enum":
        if not isinstance(v, str) or v not in s.choices:
            raise ConfigError(f"{key!r} must be one of {', '.join(s.choices)}; got {v!r}")
        return v
    if s.kind == "int":
        ok = isinstance(v, numbers.Integral) and not isinstance(v, bool)
        v = int(v) if ok else v
    elif s.kind == "float":
        ok = isinstance(v, numbers.Real) and not isinstance(v, bool)
        if ok:
            try:
                v = float(v)
            except OverflowError:  # an int of hundreds of digits: out of any range below
                bound = f" {_range_text(s)}" if s.lo is not None else ""
                raise ConfigError(f"{key!r} must be a finite number{bound}, got {_num(v)}") from None
    elif s.kind == "bool":
        ok = isinstance(v, bool)
    elif s.kind == "str":
        ok = isinstance(v, str)
    else:  # url_list
        ok = isinstance(v, (list, tuple)) and all(isinstance(u, str) for u in v)
        v = tuple(v) if ok else v
    if not ok:
        what = _KIND_NAMES[s.kind] + (" or null" if s.nullable else "")
        raise ConfigError(f"{key!r} must be {what}, got {_describe(v)}{_yaml_number_hint(s, v)}")
    if s.lo is not None:
        # Written so that NaN fails every comparison.
        in_range = (v > s.lo if s.lo_open else v >= s.lo) and (s.hi is None or (v < s.hi if s.hi_open else v <= s.hi))
        if s.pow2 and not (v > 0 and v & (v - 1) == 0):
            in_range = False
        if not in_range:
            pow2 = "a power of two " if s.pow2 else ""
            raise ConfigError(f"{key!r} must be {pow2}{_range_text(s)}, got {_num(v)}")
    if s.kind == "url_list":
        for i, u in enumerate(v):
            p = urlparse(u)
            if p.scheme not in ("http", "https") or not p.netloc:
                raise ConfigError(f"'{key}[{i}]' must be an http(s) URL, got {u!r}")
    return v


# ------------------------------------------------------------------------ sections


@dataclass(frozen=True)
class _Section:
    """Shared behaviour: validate on construction, from_dict / to_dict (a dataclass without fields)."""

    _section: ClassVar[str] = ""

    @classmethod
    def _key(cls, name: str) -> str:
        return f"{cls._section}.{name}" if cls._section else name

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            sub = f.metadata.get("section")
            if sub is not None:
                if not isinstance(v, sub):
                    object.__setattr__(self, f.name, sub.from_dict(v))
            else:
                object.__setattr__(self, f.name, _validate(self._key(f.name), f.metadata["spec"], v))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> Any:
        """Build from a (possibly partial) mapping; missing keys take defaults.

        ``None`` (an empty YAML section) means "all defaults".
        """
        if d is None:
            d = {}
        if not isinstance(d, Mapping):
            where = f"section {cls._section!r}" if cls._section else "the configuration"
            raise ConfigError(f"{where} must be a mapping of keys to values, got {_describe(d)}")
        valid = [f.name for f in fields(cls)]
        for k in d:
            if k not in valid:
                close = difflib.get_close_matches(str(k), valid, n=1)
                elsewhere = _close_key_elsewhere(str(k), cls._key(str(k))) if not close else None
                hint = (
                    f"did you mean {cls._key(close[0])!r}?"
                    if close
                    else f"did you mean {elsewhere!r}?"
                    if elsewhere
                    else f"valid keys{' of ' + repr(cls._section) if cls._section else ''}: {', '.join(valid)}"
                )
                raise ConfigError(f"unknown key {cls._key(str(k))!r}; {hint}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (lists, not tuples) that ``from_dict`` accepts."""
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, _Section):
                out[f.name] = v.to_dict()
            elif f.metadata["spec"].kind == "resources":
                out[f.name] = dict(v)
            else:
                out[f.name] = list(v) if isinstance(v, tuple) else v
        return out


@dataclass(frozen=True)
class PrefillConfig(_Section):
    _section: ClassVar[str] = "prefill"
    max_batch_size: int = _opt(32, "int", lo=1, hi=4096)
    max_seq_len: int = _opt(2048, "int", lo=16, hi=1_048_576)
    attention_backend: str = _opt("auto", "enum", choices=("auto", "sdpa", "cpu_paged", "flash_attn_v2", "triton"))
    max_num_batched_tokens: int = _opt(4096, "int", lo=1, hi=16_777_216)
    torch_threads: int = _opt(0, "int", lo=0, hi=1024)  # 0 = leave torch's default
    # engine.step() on its own thread (on) or on the event loop (off); auto = on (prefill workers on any device:
    # server/workers/engine_loop.py, resolve_engine_thread)
    engine_thread: str = _opt("auto", "enum", choices=("auto", "on", "off"))
    # weight of each prefill worker in the budget of a GPU it shares (server/memory_budget.py)
    memory_share: float = _opt(0.3, "float", lo=0, hi=1, lo_open=True)
    # precision of the prefill role (docs/FP8.md): compute dtype (auto = cache.dtype) and its own KV cache
    # dtype (auto = the compute dtype: the seed's bf16 prefill; fp8_e4m3 ships FP8 KV + scales to decode)
    dtype: str = _opt("auto", "enum", choices=_DTYPE_CHOICES)
    kv_dtype: str = _opt("auto", "enum", choices=_KV_DTYPE_CHOICES)
    # percent of the SMs of a GPU it shares with other workers, through CUDA MPS (server/mps.py); 0 = no split
    sm_share: int = _opt(0, "int", lo=0, hi=100)
    # prefill and colocated workers time one prefill batch of about this many prompt tokens at start and report
    # it at registration: the router's TTFT model predicts from its cost per token until it has measured real
    # calls (the cold-start prior, server/router/ttft_predictor.py); 0 = none (a cold router then admits only
    # what starts within its first prefill batches)
    warmup_tokens: int = _opt(512, "int", lo=0, hi=1_048_576)


@dataclass(frozen=True)
class DecodeConfig(_Section):
    _section: ClassVar[str] = "decode"
    max_batch_size: int = _opt(128, "int", lo=1, hi=4096)
    max_concurrent_requests: int = _opt(256, "int", lo=1, hi=1_000_000)
    # sequences of the decode steps each decode (or colocated) worker times at start and reports at registration:
    # the router's decode-room prior takes it as the time per output token before any stream decoded; 0 = none
    warmup_batch: int = _opt(8, "int", lo=0, hi=4096)
    attention_backend: str = _opt("auto", "enum", choices=("auto", "sdpa", "cpu_paged", "flash_attn_v2", "triton"))
    gc_interval_ms: int = _opt(500, "int", lo=1, hi=_MS_MAX)
    max_stale_slots: int = _opt(16, "int", lo=0, hi=1_000_000)
    torch_threads: int = _opt(0, "int", lo=0, hi=1024)
    engine_thread: str = _opt("auto", "enum", choices=("auto", "on", "off"))  # decode and colocated workers
    # weight of each decode (or colocated) worker in the budget of a GPU it shares
    memory_share: float = _opt(0.7, "float", lo=0, hi=1, lo_open=True)
    # precision of decode and colocated workers (docs/FP8.md): compute dtype (auto = cache.dtype), and the
    # decoder linears' weights: bf16 = as loaded (the compute dtype), fp8 = e4m3 with per-output-channel scales
    dtype: str = _opt("auto", "enum", choices=_DTYPE_CHOICES)
    weight_dtype: str = _opt("bf16", "enum", choices=("bf16", "fp8"))
    # fp8 weights only: how each weight is rounded to e4m3 under its row's scale: nearest, or gptq
    # (error-compensating rounding from shipped calibration text at load: same bytes and kernels, slower start)
    fp8_weight_rounding: str = _opt("nearest", "enum", choices=("nearest", "gptq"))
    # fp8 weights only: decoder layers kept in the compute dtype (first_last: layers 0 and L-1, which carry about
    # half of the FP8 weights' error on SmolLM2 for 2/L of the bytes; docs/FP8.md)
    fp8_bf16_layers: str = _opt("none", "enum", choices=("none", "first_last"))
    sm_share: int = _opt(0, "int", lo=0, hi=100)  # as prefill.sm_share, for decode and colocated workers


@dataclass(frozen=True)
class CacheConfig(_Section):
    _section: ClassVar[str] = "cache"
    block_size: int = _opt(16, "int", lo=1, hi=256, pow2=True)
    num_gpu_blocks: int = _opt(0, "int", lo=0, hi=10_000_000)  # 0 = size automatically
    kv_cache_memory_mb: int = _opt(512, "int", lo=1, hi=10_000_000)
    # CUDA: share of each device that its workers together may use, split among workers sharing a GPU by
    # prefill.memory_share / decode.memory_share; KV gets what weights, a profiling forward, staging pool,
    # receive buffers, CUDA graphs and the headroom leave; 0 = size from kv_cache_memory_mb as on CPU.
    gpu_memory_utilization: float = _opt(0.9, "float", lo=0, hi=1)
    # CUDA: memory each worker leaves free inside its share (cuBLAS handles of new threads, allocator slack)
    gpu_memory_headroom_mb: int = _opt(1024, "int", lo=0, hi=1_000_000)
    dtype: str = _opt("auto", "enum", choices=("auto", "float32", "float16", "bfloat16"))
    enable_prefix_caching: bool = _opt(True, "bool")
    # KV cache of decode and colocated workers (the prefill role's is prefill.kv_dtype): auto/bf16 = the
    # compute dtype; fp8_e4m3 = one byte per value with per-layer K and V scales calibrated online
    kv_dtype: str = _opt("auto", "enum", choices=_KV_DTYPE_CHOICES)
    # FP8 scale until calibrated; not below the calibration's own floor (fp8.MIN_SCALE): a smaller one is 0 in
    # float32 or saturates every value
    kv_scale_init: float = _opt(1.0, "float", lo=1e-8, hi=1e6)
    # FP8 KV scales are calibrated from the K/V amax of the first N finished requests (0 = keep kv_scale_init)
    kv_calibration_requests: int = _opt(1000, "int", lo=0, hi=100_000_000)


@dataclass(frozen=True)
class KVTransferConfig(_Section):
    _section: ClassVar[str] = "kv_transfer"
    transport: str = _opt("auto", "enum", choices=("auto", "shm", "cuda_ipc", "tcp", "nixl"))
    zero_copy_threshold_mb: float = _opt(16.0, "float", lo=0)
    lease_ms: int = _opt(30_000, "int", lo=1, hi=_MS_MAX)
    failure_policy: str = _opt("recompute", "enum", choices=("recompute", "fail"))
    pull_timeout_ms: int = _opt(10_000, "int", lo=1, hi=_MS_MAX)
    checksum: bool = _opt(True, "bool")
    cuda_ipc_pool_mb: int = _opt(2048, "int", lo=0, hi=10_000_000)  # per prefill GPU; 0 = no pool
    handshake_timeout_ms: int = _opt(2000, "int", lo=1, hi=_MS_MAX)
    max_connections: int = _opt(64, "int", lo=1, hi=65536)
    max_connections_per_peer: int = _opt(0, "int", lo=0, hi=65536)  # 0 = max_connections
    # KV hand-off by reference on one device (server/workers/kv_reference.py): off | auto | on
    by_reference: str = _opt("off", "enum", choices=("off", "auto", "on"))


@dataclass(frozen=True)
class BreakerConfig(_Section):
    _section: ClassVar[str] = "router.breaker"
    enabled: bool = _opt(False, "bool")
    metric: str = _opt("ttft", "enum", choices=("ttft", "tpot", "itl", "e2e"))
    percentile: float = _opt(99.0, "float", lo=0, hi=100, lo_open=True, hi_open=True)
    threshold_ms: float = _opt(300.0, "float", lo=0, lo_open=True)
    consecutive_s: float = _opt(5.0, "float", lo=0, lo_open=True)
    cooldown_s: float = _opt(30.0, "float", lo=0, lo_open=True)
    probe_fraction: float = _opt(0.1, "float", lo=0, hi=1, lo_open=True)
    min_samples: int = _opt(20, "int", lo=1, hi=10_000_000)
    probe_samples: int = _opt(5, "int", lo=1, hi=10_000_000)  # probes judged before half-open decides


@dataclass(frozen=True)
class AdmissionConfig(_Section):
    """Bounded queues and SLO-aware admission (server/router/admission.py). 0 = no bound of that kind."""

    _section: ClassVar[str] = "router.admission"
    max_inflight_requests: int = _opt(1024, "int", lo=0, hi=10_000_000)  # admitted and not finished
    max_queued_requests: int = _opt(512, "int", lo=0, hi=10_000_000)  # admitted, first token not yet sent
    max_queued_prefill_tokens: int = _opt(0, "int", lo=0, hi=1 << 40)  # 0 = 64 x prefill.max_num_batched_tokens
    # a request predicted to wait longer than this for its first token is refused even without an SLO
    # (0 = half of request_timeout_s): no admitted request waits without bound
    max_predicted_ttft_s: float = _opt(0.0, "float", lo=0)
    slo_ttft_ms: float = _opt(0.0, "float", lo=0)  # default of header x-slo-ttft-ms; 0 = no TTFT SLO
    slo_tpot_ms: float = _opt(0.0, "float", lo=0)  # default of header x-slo-tpot-ms; 0 = no TPOT SLO
    on_slo_miss: str = _opt("shed", "enum", choices=("shed", "queue", "backup"))  # predicted TTFT > SLO
    on_full: str = _opt("shed", "enum", choices=("shed", "backup"))  # a queue bound reached
    # a request that the shortest-first prefill would serve before queued requests, making one of them miss its
    # TTFT SLO, is handled as an SLO miss of its own (on_slo_miss): admitted requests keep their promise
    protect_admitted: bool = _opt(True, "bool")
    retry_after_s: int = _opt(1, "int", lo=1, hi=3600)  # the least Retry-After of a 429
    # client connections: 0 = from RLIMIT_NOFILE less reserved_fds (server/router/fdlimit.py)
    max_connections: int = _opt(0, "int", lo=0, hi=10_000_000)
    reserved_fds: int = _opt(128, "int", lo=16, hi=1_000_000)  # kept for /health, /metrics, workers, files


@dataclass(frozen=True)
class OutlierConfig(_Section):
    """Per-worker latency outlier ejection (server/router/outlier.py), Envoy style: a worker whose recent
    TTFT (prefill, colocated) or TPOT (decode) ``percentile`` exceeds ``factor`` x the median of its pool's
    others (and by ``min_excess_ms``), with ``min_samples`` each, gets no new request for ``ejection_s``
    (x its consecutive ejections, at most 4x); at most ``max_ejection_share`` of a pool, never its last."""

    _section: ClassVar[str] = "router.outlier"
    enabled: bool = _opt(
        False, "bool"
    )  # opt-in, as Envoy's outlier detection: a drill that slows one worker expects it served
    factor: float = _opt(3.0, "float", lo=1, lo_open=True)
    percentile: float = _opt(0.9, "float", lo=0, hi=1, lo_open=True)
    min_samples: int = _opt(8, "int", lo=1, hi=100_000)
    window_s: float = _opt(60.0, "float", lo=0, lo_open=True)  # samples older than this are forgotten
    min_excess_ms: float = _opt(50.0, "float", lo=0)
    ejection_s: float = _opt(30.0, "float", lo=0, lo_open=True)
    max_ejection_share: float = _opt(0.5, "float", lo=0, hi=1)


@dataclass(frozen=True)
class RouterConfig(_Section):
    _section: ClassVar[str] = "router"
    host: str = _opt("127.0.0.1", "str")
    port: int = _opt(8080, "int", lo=0, hi=65535)  # 0 = pick a free port
    # the control plane's server (worker heartbeats, on a thread of its own: server/router/control.py) listens
    # here, on a free port chosen at start and named to workers in the registration reply; "" = none (every
    # heartbeat on the main port, read by the data plane's event loop)
    control_host: str = _opt("127.0.0.1", "str")
    backup_pool: tuple[str, ...] = _opt((), "url_list")
    backup_model: str | None = _opt(None, "str", nullable=True)  # `model` sent to the backup; None = as given
    backup_api_key: str | None = _opt(None, "str", nullable=True)  # Bearer token for the backup pool
    sla_window_s: int = _opt(60, "int", lo=1, hi=3600)  # rolling-percentile window, seconds
    journal_path: str | None = _opt(None, "str", nullable=True)  # JSON lines of finished requests
    event_journal_path: str | None = _opt(None, "str", nullable=True)  # JSON lines of breaker transitions
    # the defaults of a request that leaves temperature/top_p out (server/router/sampling_defaults.py); once
    # decode.sampling_strategy and decode.top_p (server/config_moves.py)
    sampling_strategy: str = _opt("top_p", "enum", choices=("greedy", "top_p"))
    top_p: float = _opt(0.95, "float", lo=0, hi=1, lo_open=True)
    heartbeat_interval_ms: int = _opt(1000, "int", lo=1, hi=_MS_MAX)
    heartbeat_timeout_ms: int = _opt(3000, "int", lo=1, hi=_MS_MAX)
    request_timeout_s: float = _opt(600.0, "float", lo=0, lo_open=True)
    stream_progress_timeout_s: float = _opt(10.0, "float", lo=0, lo_open=True)
    max_request_body_bytes: int = _opt(8 << 20, "int", lo=1024, hi=1 << 31)
    max_prompt_chars: int = _opt(0, "int", lo=0, hi=1 << 31)  # 0 = 32 x prefill.max_seq_len
    header_timeout_s: float = _opt(10.0, "float", lo=0, lo_open=True)
    body_timeout_s: float = _opt(30.0, "float", lo=0, lo_open=True)
    keepalive_timeout_s: float = _opt(30.0, "float", lo=0, lo_open=True)
    # a client that reads nothing of its answer for this long is disconnected (server/router/limits.py)
    stream_write_timeout_s: float = _opt(30.0, "float", lo=0, lo_open=True)
    # None = read env DISTSERVE_ADMIN_TOKEN, else `serve` generates one (a router or worker started alone needs it).
    admin_token: str | None = _opt(None, "str", nullable=True)
    # false: a request field the OpenAI routes do not know is a 400 naming it; true: ignored (vendor extras)
    allow_unknown_fields: bool = _opt(False, "bool")
    breaker: BreakerConfig = _sub(BreakerConfig)
    admission: AdmissionConfig = _sub(AdmissionConfig)
    # Cache-aware routing (server/router/registry.py pick): score = load + prefix_cache_weight x the share of
    # the prompt the worker has not cached; 0 = least load only. Summaries older than the max age count as none.
    prefix_cache_weight: float = _opt(2.0, "float", lo=0, hi=1e6)
    prefix_summary_max_age_s: float = _opt(10.0, "float", lo=0, lo_open=True)
    # Conditional disaggregation (server/router/pipeline.py): prefill on the decode worker when the part of
    # the prompt it has not cached is at most this many tokens (0 = never for that reason), or when every
    # prefill worker's load is at least local_prefill_prefill_load and the decode worker queues nothing (0 = off)
    local_prefill_max_tokens: int = _opt(0, "int", lo=0, hi=1 << 30)
    local_prefill_prefill_load: float = _opt(0.0, "float", lo=0, hi=1e6)
    outlier: OutlierConfig = _sub(OutlierConfig)


@dataclass(frozen=True)
class RayRouterPool(_Section):
    """What the router's Ray actor asks for (``distserve serve --launcher ray``). ``resources`` are Ray
    resources: custom ones a node was started with (``ray start --resources '{"prefill_node": 4}'``),
    plus ``CPU`` and ``GPU``. Empty: one CPU, on the node that runs ``distserve serve``."""

    _section: ClassVar[str] = "ray.router"
    resources: tuple[tuple[str, float], ...] = _opt((), "resources")


@dataclass(frozen=True)
class RayPrefillPool(_Section):
    """What each prefill worker's Ray actor asks for; ``CPU`` defaults to 1, ``GPU`` to 1 on CUDA."""

    _section: ClassVar[str] = "ray.prefill"
    resources: tuple[tuple[str, float], ...] = _opt((), "resources")


@dataclass(frozen=True)
class RayDecodePool(_Section):
    """What each decode (or colocated) worker's Ray actor asks for; as ``ray.prefill``."""

    _section: ClassVar[str] = "ray.decode"
    resources: tuple[tuple[str, float], ...] = _opt((), "resources")


@dataclass(frozen=True)
class RayConfig(_Section):
    """``distserve serve --launcher ray`` and ``distserve scale``; ignored by the local launcher."""

    _section: ClassVar[str] = "ray"
    address: str | None = _opt(None, "str", nullable=True)  # None = $RAY_ADDRESS, else the local cluster
    namespace: str = _opt("distserve", "str")
    deployment: str = _opt("distserve", "str")  # name of the controller actor that `distserve scale` finds
    drain_timeout_s: float = _opt(120.0, "float", lo=0, lo_open=True)  # then the rest migrate
    start_timeout_s: float = _opt(300.0, "float", lo=0, lo_open=True)  # a worker placed, loaded, registered
    router: RayRouterPool = _sub(RayRouterPool)
    prefill: RayPrefillPool = _sub(RayPrefillPool)
    decode: RayDecodePool = _sub(RayDecodePool)


@dataclass(frozen=True)
class DistServeConfig(_Section):
    model: str | None = _opt(None, "str", nullable=True)  # None = built-in tiny model
    prefill: PrefillConfig = _sub(PrefillConfig)
    decode: DecodeConfig = _sub(DecodeConfig)
    cache: CacheConfig = _sub(CacheConfig)
    kv_transfer: KVTransferConfig = _sub(KVTransferConfig)
    router: RouterConfig = _sub(RouterConfig)
    ray: RayConfig = _sub(RayConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_precision(self)


# Attention backends that read an FP8 KV cache (the C++ CPU kernel and flash-attn read the compute dtype only).
_FP8_KV_BACKENDS = ("auto", "sdpa", "triton")


def _check_precision(cfg: DistServeConfig) -> None:
    """Cross-key rules of per-role precision, checked once with the rest of the configuration."""
    roles = (("prefill", "prefill.kv_dtype", cfg.prefill.kv_dtype), ("decode", "cache.kv_dtype", cfg.cache.kv_dtype))
    for role, kv_key, kv in roles:
        backend = getattr(cfg, role).attention_backend
        if kv == "fp8_e4m3" and backend not in _FP8_KV_BACKENDS:
            raise ConfigError(
                f"{kv_key!r} fp8_e4m3 needs {role}.attention_backend one of {', '.join(_FP8_KV_BACKENDS)}; "
                f"got {backend!r}"
            )
    fp8_kv = [key for _, key, kv in roles if kv == "fp8_e4m3"]
    if cfg.kv_transfer.by_reference == "on" and fp8_kv:
        raise ConfigError(
            f"'kv_transfer.by_reference' on needs a KV cache in the compute dtype on both roles, got {fp8_kv[0]} "
            "fp8_e4m3 (an FP8 cache is never shared: each worker has its own scales); use auto or off"
        )
    for key, value, default in (
        ("fp8_weight_rounding", cfg.decode.fp8_weight_rounding, "nearest"),
        ("fp8_bf16_layers", cfg.decode.fp8_bf16_layers, "none"),
    ):
        if value != default and cfg.decode.weight_dtype != "fp8":
            raise ConfigError(
                f"'decode.{key}' {value} applies to FP8 weights only: it needs decode.weight_dtype fp8, "
                f"got {cfg.decode.weight_dtype!r}"
            )
    pf, dc = role_dtype(cfg, "prefill"), role_dtype(cfg, "decode")
    if pf != dc:
        raise ConfigError(
            f"'prefill.dtype' ({pf}) and 'decode.dtype' ({dc}) must resolve to one compute dtype: the KV a prefill "
            "worker makes is read by decode workers (FP8 storage is chosen by decode.weight_dtype and cache.kv_dtype)"
        )


def role_dtype(cfg: DistServeConfig, role: str) -> str:
    """A role's compute dtype: ``prefill.dtype`` / ``decode.dtype``, ``auto`` meaning ``cache.dtype``."""
    own = cfg.prefill.dtype if role == "prefill" else cfg.decode.dtype
    return own if own != "auto" else cfg.cache.dtype


# -------------------------------------------------------------------------- loading


def _all_keys(cls: type = DistServeConfig, prefix: str = "") -> list[str]:
    """Every dotted leaf key of the configuration (``kv_transfer.zero_copy_threshold_mb``, ...)."""
    out = []
    for f in fields(cls):
        sub = f.metadata.get("section")
        out.extend(_all_keys(sub, f"{prefix}{f.name}.") if sub else [f"{prefix}{f.name}"])
    return out


def _close_key_elsewhere(name: str, dotted: str) -> str | None:
    """A key in another section whose name is close to ``name`` (a key put in the wrong section, or a
    section name that is a key elsewhere, e.g. ``rdma`` → nothing, ``zero_copy_threshold`` → kv_transfer's)."""
    keys = _all_keys()
    leaves = {k.rsplit(".", 1)[-1]: k for k in keys}
    close = difflib.get_close_matches(name, list(leaves), n=1, cutoff=0.75)
    if close:
        return leaves[close[0]]
    close = difflib.get_close_matches(dotted, keys, n=1, cutoff=0.75)
    return close[0] if close else None


def _merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """Recursive merge; a mapping merges into a mapping, anything else replaces."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) else v
    return out


def _read_yaml(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config file: {e.strerror or e}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"{where}: invalid YAML: {problem}") from None


def load_config(path: str | Path | None = None, overrides: Mapping[str, Any] | None = None) -> DistServeConfig:
    """Load ``path`` (None = built-in defaults), then merge nested ``overrides``.

    The file is validated on its own first, so its errors name the file; the
    overrides (e.g. from CLI flags) are then merged and validated the same way.
    """
    cfg = DistServeConfig()
    if path is not None:
        from distserve.server.config_aliases import apply_aliases
        from distserve.server.config_moves import apply_moves

        try:
            raw = apply_aliases(_read_yaml(find_config(path)), str(path))[0]
            cfg = DistServeConfig.from_dict(apply_moves(raw, str(path))[0])
        except ConfigError as e:
            msg = str(e)
            raise ConfigError(msg if msg.startswith(str(path)) else f"{path}: {msg}") from None
    if overrides:
        if not isinstance(overrides, Mapping):
            raise ConfigError(f"overrides must be a mapping, got {_describe(overrides)}")
        from distserve.server.config_moves import apply_moves

        cfg = DistServeConfig.from_dict(_merge(cfg.to_dict(), apply_moves(overrides, "overrides")[0]))
    return cfg
