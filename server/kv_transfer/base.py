"""The two-sided seam between a prefill worker (sender) and a decode worker (receiver).

A prefill worker *stages* one request's KV tensor and gets a `KVHandle` back; the handle travels
through the router as JSON; the decode worker *pulls* with it when it has room for the request.
Failures are data: `pull` never raises, it returns a `PullResult` whose status says what happened,
so the caller can apply its `failure_policy` (recompute | fail) without try/except around I/O.

Status of one staged transfer, as seen by the sender::

    PENDING ──pull──▶ TRANSFERRING ──ACK──▶ SUCCESS
       │  ▲                 │
       │  └──receiver error─┘ (stays staged: decode may retry until the lease ends)
       ├──lease ends──▶ EXPIRED
       └──abort()─────▶ ABORTED                 (FAILED is what a receiver reports)
"""

from __future__ import annotations

import abc
import enum
import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from distserve.server.engine.fp8 import positive_finite

from .frame import DEFAULT_MAX_NBYTES, DTYPE_NAMES, MAX_NDIM, MAX_REQUEST_ID_BYTES, MAX_SECRET_BYTES

TRANSPORTS = ("tcp", "shm", "cuda_ipc")
MAX_ADDRESS_CHARS = 300
MAX_HOST_ID_CHARS = 512
MAX_IPC_CHARS = 1024  # cuda_ipc description text (cuda_ipc.parse_description caps it too)
_HEX = re.compile(r"[0-9a-f]+")
_HARD_MAX_NBYTES = 1 << 46  # any handle at all; from_dict applies the (smaller) configured cap


class TransferStatus(enum.Enum):
    PENDING = "pending"
    TRANSFERRING = "transferring"
    SUCCESS = "success"
    FAILED = "failed"
    EXPIRED = "expired"
    ABORTED = "aborted"

    @property
    def is_finished(self) -> bool:
        return self not in (TransferStatus.PENDING, TransferStatus.TRANSFERRING)


def _check_int(name: str, value: Any, lo: int, hi: int) -> int:
    if type(value) is not int:  # bool is an int subclass and never a size
        raise ValueError(f"KVHandle.{name} must be an int, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise ValueError(f"KVHandle.{name}={value} outside [{lo}, {hi}]")
    return value


def _check_str(name: str, value: Any, max_len: int, min_len: int = 1) -> str:
    if not isinstance(value, str):
        raise ValueError(f"KVHandle.{name} must be a str, got {type(value).__name__}")
    n = len(value.encode("utf-8"))
    if not min_len <= n <= max_len:
        raise ValueError(f"KVHandle.{name} is {n} bytes, must be {min_len}..{max_len}")
    return value


def parse_address(address: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"KV address {address!r} is not host:port")
    return host.strip("[]"), int(port)


MAX_KV_SCALE_LAYERS = 1024


def check_kv_scales(scales: Any, dtype: str, shape: tuple[int, ...]) -> None:
    """FP8 payloads carry one finite, positive [K, V] scale pair per layer; other dtypes carry none."""
    if dtype != "float8_e4m3fn":
        if scales:
            raise ValueError(f"KVHandle.kv_scales is only for dtype float8_e4m3fn, not {dtype}")
        return
    if not isinstance(scales, tuple) or not shape or len(scales) != shape[0]:
        raise ValueError(f"KVHandle.kv_scales must hold one [k, v] pair per layer ({shape[0] if shape else 0})")
    for pair in scales:
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise ValueError("KVHandle.kv_scales entries must be [k, v] pairs")
        for x in pair:
            if not positive_finite(x):
                raise ValueError(f"KVHandle.kv_scales values must be finite float32 numbers > 0, got {str(x)[:40]}")


@dataclass(frozen=True)
class KVHandle:
    """Everything a receiver needs to pull one request's KV; JSON-safe via to_dict/from_dict.

    `secret` authenticates the pull (random per transfer), so a handle is a capability: log its
    request id, never the whole dict.
    """

    request_id: str
    transport: str
    address: str
    secret: str
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    checksum: int | None
    host_id: str
    # cuda_ipc from a staging pool: the sender's IPC description of the staged bytes, so the
    # receiver can start its copy before the PULL's reply arrives (receiver.py); "" otherwise
    ipc: str = ""
    # FP8 KV (dtype float8_e4m3fn) only, and then required: per layer the [K, V] scales it was quantised
    # with (x = q * scale), one pair per shape[0] layer, each finite and > 0
    kv_scales: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        self.validate(_HARD_MAX_NBYTES)

    def validate(self, max_nbytes: int = DEFAULT_MAX_NBYTES) -> None:
        _check_str("request_id", self.request_id, MAX_REQUEST_ID_BYTES)
        if self.transport not in TRANSPORTS:
            raise ValueError(f"KVHandle.transport={self.transport!r}, expected one of {TRANSPORTS}")
        _check_str("address", self.address, MAX_ADDRESS_CHARS)
        parse_address(self.address)
        _check_str("secret", self.secret, MAX_SECRET_BYTES, min_len=16)
        if not _HEX.fullmatch(self.secret):
            raise ValueError("KVHandle.secret must be lowercase hex")
        if not isinstance(self.shape, tuple) or len(self.shape) > MAX_NDIM:
            raise ValueError(f"KVHandle.shape must be a tuple of at most {MAX_NDIM} ints")
        for dim in self.shape:
            _check_int("shape[i]", dim, 0, max_nbytes)
        if not isinstance(self.dtype, str) or self.dtype not in DTYPE_NAMES:
            raise ValueError(f"KVHandle.dtype={self.dtype!r}, expected one of {sorted(DTYPE_NAMES)}")
        _check_int("nbytes", self.nbytes, 0, max_nbytes)
        itemsize = DTYPE_NAMES[self.dtype].itemsize
        if math.prod(self.shape) * itemsize != self.nbytes:
            raise ValueError(f"KVHandle.nbytes={self.nbytes} != prod(shape {self.shape}) * itemsize {itemsize}")
        if self.checksum is not None:
            _check_int("checksum", self.checksum, 0, 0xFFFFFFFF)
        _check_str("host_id", self.host_id, MAX_HOST_ID_CHARS)
        if not isinstance(self.ipc, str) or len(self.ipc) > MAX_IPC_CHARS:
            raise ValueError(f"KVHandle.ipc must be a string of at most {MAX_IPC_CHARS} chars")
        if self.ipc and self.transport != "cuda_ipc":
            raise ValueError("KVHandle.ipc is only for transport cuda_ipc")
        check_kv_scales(self.kv_scales, self.dtype, self.shape)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPE_NAMES[self.dtype]

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "transport": self.transport,
            "address": self.address,
            "secret": self.secret,
            "nbytes": self.nbytes,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "checksum": self.checksum,
            "host_id": self.host_id,
            **({"ipc": self.ipc} if self.ipc else {}),
            **({"kv_scales": [list(p) for p in self.kv_scales]} if self.kv_scales else {}),
        }

    @classmethod
    def from_dict(cls, data: Any, max_nbytes: int = DEFAULT_MAX_NBYTES) -> KVHandle:
        """Build from untrusted JSON: exact key set, strict types, size caps. Raises ValueError."""
        if not isinstance(data, dict):
            raise ValueError(f"KV handle must be a JSON object, got {type(data).__name__}")
        expected = {"request_id", "transport", "address", "secret", "nbytes", "shape", "dtype", "checksum", "host_id"}
        if set(data) - {"ipc", "kv_scales"} != expected:
            missing, extra = sorted(expected - set(data)), sorted(set(data) - expected)
            raise ValueError(f"KV handle keys: missing {missing}, unexpected {extra}")
        shape = data["shape"]
        if not isinstance(shape, (list, tuple)) or len(shape) > MAX_NDIM:
            raise ValueError(f"KVHandle.shape must be a list of at most {MAX_NDIM} ints")
        scales = data.get("kv_scales", ())
        if not isinstance(scales, (list, tuple)) or len(scales) > MAX_KV_SCALE_LAYERS:
            raise ValueError(f"KVHandle.kv_scales must be a list of at most {MAX_KV_SCALE_LAYERS} [k, v] pairs")
        if not all(isinstance(p, (list, tuple)) for p in scales):
            raise ValueError("KVHandle.kv_scales entries must be [k, v] pairs")
        handle = cls(**dict(data, shape=tuple(shape), kv_scales=tuple(tuple(p) for p in scales)))
        handle.validate(max_nbytes)
        return handle


@dataclass
class PullResult:
    status: TransferStatus
    tensor: torch.Tensor | None
    error: str | None
    nbytes: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status is TransferStatus.SUCCESS


class KVSender(abc.ABC):
    """Prefill side: holds staged KV under a lease until it is pulled, released or expires."""

    @abc.abstractmethod
    def stage(
        self,
        request_id: str,
        tensor: torch.Tensor,
        lease_ms: float | None = None,
        *,
        transport: str = "tcp",
        checksum: bool | None = None,
    ) -> KVHandle: ...

    @abc.abstractmethod
    def abort(self, request_id: str) -> bool:
        """Cancel a staged entry (status ABORTED); True if it was still staged."""

    @abc.abstractmethod
    def poll(self, request_id: str) -> TransferStatus | None:
        """Current status, or the terminal status of a recently finished transfer, or None."""

    @property
    @abc.abstractmethod
    def num_staged(self) -> int: ...

    @property
    @abc.abstractmethod
    def staged_bytes(self) -> int: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class KVReceiver(abc.ABC):
    """Decode side: pulls a staged tensor. Never raises for transfer failures."""

    @abc.abstractmethod
    def pull(self, handle: KVHandle, timeout_s: float = 30.0, *, out: torch.Tensor | None = None) -> PullResult: ...

    def close(self) -> None:  # noqa: B027 (optional hook: most receivers hold nothing to close)
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
