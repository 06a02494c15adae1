"""Binary frames of the KV data plane.

Every message between a KV sender and a KV receiver is one frame: a fixed-size header packed with
`struct` (network byte order), then three short length-prefixed fields (request id, secret, text),
then — for DATA_INLINE only — the raw payload bytes. Nothing is ever pickled: a frame from the wire
is only ever interpreted as integers and short UTF-8 strings, and every size field is checked against
hard limits *before* anything is allocated for it (vLLM CVE-2025-47277 was a pickle on this path).

Header layout (92 bytes, in this order)::

    magic            4s   b"DSKV"
    version          H    VERSION
    frame type       B    FrameType
    flags            B    FLAG_CHECKSUM
    error code       B    ErrorCode (ERROR frames)
    dtype code       B    DTYPE_CODES (data frames; 0 otherwise)
    ndim             B    <= 8
    secret length    B    <= 64
    request id len   H    <= 256
    text length      H    <= 1024 (ERROR message, shm segment name of DATA_SHM, or the IPC
                          description of DATA_CUDA_IPC)
    shape            8Q   unused dims must be 0
    payload nbytes   Q    == prod(shape) * itemsize, <= max_nbytes
    checksum         I    crc32 of the payload when FLAG_CHECKSUM is set, else 0

One connection carries many pulls, one at a time (the receiver opens it, keeps it in a pool and
closes it; the sender closes it after `idle_timeout_s` without a frame, or when it is closed)::

    receiver  PULL(id, secret)
    sender    DATA_INLINE + payload | DATA_SHM | DATA_CUDA_IPC
              | ERROR UNKNOWN_ID, EXPIRED, AUTH or BUSY   (the connection stays usable)
              | ERROR BAD_FRAME                            (the sender then closes: out of sync)
    receiver  ACK(id)   payload received and verified
              | ERROR CHECKSUM or GENERIC                  (the entry stays staged; the receiver
                                                            closes the connection)
    sender    DONE(id)  after ACK: the entry is unstaged (its memory is freed after DONE is
                        sent); the connection is ready for the next PULL

A receiver returns a successful pull only once DONE arrived, so the staging slot is free when
pull() returns. DONE is type 7, appended: an older receiver, which waits for the sender to close
after its ACK, takes DONE's first byte for that and still works; a receiver facing an older sender
(which closes instead of answering DONE) takes the close as the confirmation and does not reuse the
connection. Hence no version bump: the header format is unchanged.
"""

from __future__ import annotations

import enum
import math
import socket
import struct
from dataclasses import dataclass

import torch

MAGIC = b"DSKV"
VERSION = 1
MAX_NDIM = 8
MAX_REQUEST_ID_BYTES = 256
MAX_SECRET_BYTES = 64
MAX_TEXT_BYTES = 1024
DEFAULT_MAX_NBYTES = 64 << 30  # 64 GiB

FLAG_CHECKSUM = 0x01

_HEADER = struct.Struct("!4sHBBBBBBHH8QQI")
HEADER_SIZE = _HEADER.size

# Wire codes are part of the protocol: never renumber, only append.
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.int8: 4,
    torch.uint8: 5,
    torch.float8_e4m3fn: 6,  # an FP8 KV cache's bytes; its scales travel in the handle (KVHandle.kv_scales)
}
_CODE_TO_DTYPE = {code: dtype for dtype, code in DTYPE_CODES.items()}
DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "float8_e4m3fn": torch.float8_e4m3fn,
}


class FrameError(ValueError):
    """A frame (or a size field in it) is malformed or outside the protocol's limits."""


class FrameType(enum.IntEnum):
    PULL = 1  # receiver -> sender: request id + secret
    DATA_INLINE = 2  # sender -> receiver: metadata, payload follows on the stream
    DATA_SHM = 3  # sender -> receiver: metadata, text = shared-memory segment name
    ACK = 4  # receiver -> sender: payload received and verified, free it
    ERROR = 5  # either way: code + text, no data
    DATA_CUDA_IPC = 6  # sender -> receiver: metadata, text = CUDA IPC description (JSON, cuda_ipc.py)
    DONE = 7  # sender -> receiver: ACK handled, entry unstaged, ready for the next PULL


class ErrorCode(enum.IntEnum):
    NONE = 0
    GENERIC = 1
    UNKNOWN_ID = 2
    EXPIRED = 3
    AUTH = 4
    BUSY = 5
    CHECKSUM = 6
    BAD_FRAME = 7


_DATA_TYPES = (FrameType.DATA_INLINE, FrameType.DATA_SHM, FrameType.DATA_CUDA_IPC)


@dataclass(frozen=True)
class Frame:
    """A decoded frame header. `dtype` is None for frames that carry no payload metadata."""

    type: FrameType
    request_id: str = ""
    secret: str = ""
    dtype: torch.dtype | None = None
    shape: tuple[int, ...] = ()
    nbytes: int = 0
    checksum: int | None = None
    error_code: ErrorCode = ErrorCode.NONE
    text: str = ""


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPE_NAMES.items():
        if value == dtype:
            return name
    raise ValueError(f"unsupported KV dtype {dtype}; supported: {sorted(DTYPE_NAMES)}")


def expected_nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _encode_str(value: str, limit: int, what: str) -> bytes:
    raw = value.encode("utf-8")
    if len(raw) > limit:
        raise FrameError(f"{what} is {len(raw)} bytes, limit is {limit}")
    return raw


def encode_frame(frame: Frame) -> bytes:
    """Header + variable fields (the payload of DATA_INLINE is sent separately, unbuffered)."""
    rid = _encode_str(frame.request_id, MAX_REQUEST_ID_BYTES, "request id")
    secret = _encode_str(frame.secret, MAX_SECRET_BYTES, "secret")
    text = _encode_str(frame.text, MAX_TEXT_BYTES, "text")
    if len(frame.shape) > MAX_NDIM:
        raise FrameError(f"ndim {len(frame.shape)} exceeds {MAX_NDIM}")
    dtype_code = 0 if frame.dtype is None else DTYPE_CODES.get(frame.dtype)
    if dtype_code is None:
        raise FrameError(f"unsupported dtype {frame.dtype}")
    shape = tuple(int(d) for d in frame.shape) + (0,) * (MAX_NDIM - len(frame.shape))
    flags = 0 if frame.checksum is None else FLAG_CHECKSUM
    header = _HEADER.pack(
        MAGIC,
        VERSION,
        int(frame.type),
        flags,
        int(frame.error_code),
        dtype_code,
        len(frame.shape),
        len(secret),
        len(rid),
        len(text),
        *shape,
        frame.nbytes,
        frame.checksum or 0,
    )
    return header + rid + secret + text


@dataclass(frozen=True)
class _Fixed:
    frame: Frame  # without the variable fields
    rid_len: int
    secret_len: int
    text_len: int


def decode_header(buf: bytes | bytearray | memoryview, max_nbytes: int = DEFAULT_MAX_NBYTES) -> _Fixed:
    """Validate the fixed header; returns the lengths of the variable fields that follow."""
    if len(buf) < HEADER_SIZE:
        raise FrameError(f"short header: {len(buf)} of {HEADER_SIZE} bytes")
    (magic, version, ftype, flags, ecode, dcode, ndim, secret_len, rid_len, text_len, *rest) = _HEADER.unpack_from(buf)
    dims, nbytes, checksum = rest[:MAX_NDIM], rest[MAX_NDIM], rest[MAX_NDIM + 1]
    if magic != MAGIC:
        raise FrameError(f"bad magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise FrameError(f"unsupported protocol version {version}, this side speaks {VERSION}")
    try:
        ftype = FrameType(ftype)
        ecode = ErrorCode(ecode)
    except ValueError as exc:
        raise FrameError(f"bad frame: {exc}") from None
    if flags & ~FLAG_CHECKSUM:
        raise FrameError(f"unknown flag bits 0x{flags:02x}")
    if ndim > MAX_NDIM:
        raise FrameError(f"ndim {ndim} exceeds {MAX_NDIM}")
    if any(dims[ndim:]):
        raise FrameError("shape has non-zero entries beyond ndim")
    if rid_len > MAX_REQUEST_ID_BYTES or secret_len > MAX_SECRET_BYTES or text_len > MAX_TEXT_BYTES:
        raise FrameError(
            f"variable field too long (request id {rid_len}, secret {secret_len}, "
            f"text {text_len}; limits {MAX_REQUEST_ID_BYTES}/{MAX_SECRET_BYTES}/"
            f"{MAX_TEXT_BYTES})"
        )
    if not flags & FLAG_CHECKSUM and checksum:
        raise FrameError("checksum set without the checksum flag")
    shape = tuple(dims[:ndim])
    if ftype in _DATA_TYPES:
        dtype = _CODE_TO_DTYPE.get(dcode)
        if dtype is None:
            raise FrameError(f"unknown dtype code {dcode}")
        want = expected_nbytes(shape, dtype)
        if nbytes != want:
            raise FrameError(f"payload nbytes {nbytes} != prod(shape {shape}) * itemsize = {want}")
        if nbytes > max_nbytes:
            raise FrameError(f"payload nbytes {nbytes} exceeds limit {max_nbytes}")
    else:
        if dcode or ndim or nbytes or flags:
            raise FrameError(f"{ftype.name} frame must not carry payload metadata")
        dtype = None
    frame = Frame(
        type=ftype,
        dtype=dtype,
        shape=shape,
        nbytes=nbytes,
        error_code=ecode,
        checksum=checksum if flags & FLAG_CHECKSUM else None,
    )
    return _Fixed(frame, rid_len, secret_len, text_len)


def _decode_str(raw: bytes | bytearray | memoryview, what: str) -> str:
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        raise FrameError(f"{what} is not valid UTF-8") from None


def _complete(fixed: _Fixed, var: bytes | bytearray | memoryview) -> Frame:
    a, b = fixed.rid_len, fixed.rid_len + fixed.secret_len
    f = fixed.frame
    return Frame(
        type=f.type,
        dtype=f.dtype,
        shape=f.shape,
        nbytes=f.nbytes,
        checksum=f.checksum,
        error_code=f.error_code,
        request_id=_decode_str(var[:a], "request id"),
        secret=_decode_str(var[a:b], "secret"),
        text=_decode_str(var[b : b + fixed.text_len], "text"),
    )


def decode_frame(buf: bytes | bytearray | memoryview, max_nbytes: int = DEFAULT_MAX_NBYTES) -> Frame:
    """Decode a complete frame (header + variable fields) held in memory."""
    fixed = decode_header(buf, max_nbytes)
    end = HEADER_SIZE + fixed.rid_len + fixed.secret_len + fixed.text_len
    if len(buf) < end:
        raise FrameError(f"truncated frame: {len(buf)} of {end} bytes")
    return _complete(fixed, memoryview(buf)[HEADER_SIZE:end])


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    """Read exactly n bytes (n is small and already validated); EOF raises ConnectionError."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError(f"connection closed after {got} of {n} frame bytes")
        got += k
    return buf


def read_frame(sock: socket.socket, max_nbytes: int = DEFAULT_MAX_NBYTES) -> Frame:
    fixed = decode_header(recv_exact(sock, HEADER_SIZE), max_nbytes)
    nvar = fixed.rid_len + fixed.secret_len + fixed.text_len
    return _complete(fixed, recv_exact(sock, nvar) if nvar else b"")


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """Zero-copy flat byte view of a contiguous CPU tensor (bfloat16 too, which numpy lacks)."""
    if not tensor.is_contiguous():
        raise ValueError("tensor must be contiguous")
    flat = tensor.detach().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")  # type: ignore[arg-type]  # ndarray is a buffer; stubs lack __buffer__
