"""`cuda_ipc`: same-host GPU→GPU KV transfer with no host copy.

The prefill worker's KV stays on its GPU. A PULL for a `cuda_ipc` entry is answered with a
`DATA_CUDA_IPC` frame whose text is a small JSON object (ints, bools, lowercase hex; never a
pickle) naming the CUDA IPC handle of the memory that holds the staged bytes. The receiver opens
the handle (``torch.UntypedStorage._new_shared_cuda``), copies device-to-device into a tensor of
its own on its own device (another GPU of the host works too: the copy goes peer-to-peer), waits
for the copy, closes what it opened, and only then sends ACK; the sender frees on ACK.

Where the staged bytes live (sender side):

- a **staging pool**: one large buffer per GPU, exported once. Receivers keep their mapping of it
  open (small LRU), so a pull costs a control round trip, the copy and a sync: opening and
  closing an IPC mapping of a big allocation costs about as much as copying 1 GiB;
- when the pool is full (or disabled), the gathered tensor itself, exported per transfer; the
  receiver opens it, copies, and closes the mapping again.

Lifetime. ``_share_cuda_`` puts the exported storage behind torch's producer-side reference
counter (a slot in a shared-memory file, starting at 1: "one consumer still holds it"). Torch's
consumer would decrement it when it drops its storage; here the *ACK* is the only word that
counts, so the receiver points its decrement at a counter slot of its own (a 1-byte tensor it
exported itself, the "sink") and the sender releases its own slot when it frees the entry (ACK,
lease expiry, abort, close). A receiver that crashes mid-pull therefore cannot pin prefill memory
for ever, and a receiver that retries cannot drive the count below zero (which would send the
block to torch's limbo list: a leak).

What the receiver checks before it opens anything: exact key set, types, lengths and ranges of
every field; the GPU named by UUID must be visible to it; ``offset + nbytes`` must lie inside
the exported storage; the handle must be a plain ``cudaMalloc`` IPC handle (torch's versioned
'c' form, or the legacy bare 64 bytes) — torch's expandable-segment form ('e') makes the opener
fetch file descriptors out of a process id named in the handle, which no peer gets to ask for.
"""

from __future__ import annotations

import collections
import json
import logging
import re
import secrets
import threading
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

IPC_VERSION = 1
CUDA_IPC_HANDLE_SIZE = 64
_MAX_HANDLE = 130
_TORCH_HANDLE_CUDA_MALLOC = ord("c")
_HEX = re.compile(r"(?:[0-9a-f]{2})+")
_UUID = re.compile(r"[A-Za-z0-9-]{8,64}")
_POOL_ID = re.compile(r"[0-9a-f]{32}")
_KEYS = frozenset({"v", "pool", "dev", "handle", "size", "soff", "off", "event", "sync"})
_MAX_SIZE = 1 << 46
_ALIGN = 512
_RECEIVER_CACHE = 8  # pool mappings a receiver keeps open


class IpcError(ValueError):
    """An IPC description is malformed, names memory we may not open, or opening/copying failed."""


# ---------------------------------------------------------------- devices
_uuid_lock = threading.Lock()
_uuids: dict[int, str] = {}


def gpu_uuid(device: torch.device | int) -> str:
    """Stable identity of a GPU across processes (indices differ under CUDA_VISIBLE_DEVICES)."""
    index = (
        device
        if isinstance(device, int)
        else (device.index if device.index is not None else torch.cuda.current_device())
    )
    with _uuid_lock:
        if index not in _uuids:
            props = torch.cuda.get_device_properties(index)
            uuid = str(getattr(props, "uuid", "") or "")
            if not _UUID.fullmatch(uuid):  # a torch without it: indices, same visibility assumed
                uuid = f"cuda-index-{index:04d}"
            _uuids[index] = uuid
        return _uuids[index]


def visible_gpu_uuids() -> list[str]:
    if not torch.cuda.is_available():
        return []
    return [gpu_uuid(i) for i in range(torch.cuda.device_count())]


def local_index(uuid: str) -> int | None:
    for i in range(torch.cuda.device_count()):
        if gpu_uuid(i) == uuid:
            return i
    return None


def record_ready(tensor: torch.Tensor) -> torch.cuda.Event | None:
    """Event after the work that produced `tensor` (call on the thread that queued it)."""
    if not tensor.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensor.device))
    return event


_streams: dict[tuple[int, int], torch.cuda.Stream] = {}
_streams_lock = threading.Lock()


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """A non-blocking stream per (thread, device): copies here never queue behind engine steps."""
    key = (threading.get_ident(), device.index if device.index is not None else torch.cuda.current_device())
    with _streams_lock:
        s = _streams.get(key)
        if s is None:
            s = _streams[key] = torch.cuda.Stream(device=key[1])
        return s


def to_pinned_host(tensor: torch.Tensor, ready: torch.cuda.Event | None = None) -> torch.Tensor:
    """Copy a CUDA tensor into pinned host memory (for tcp/shm from a GPU worker); waits for it."""
    if not tensor.is_cuda:
        return tensor
    stream = side_stream(tensor.device)
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    with torch.cuda.stream(stream):
        if ready is not None:
            stream.wait_event(ready)
        else:
            stream.wait_stream(torch.cuda.default_stream(tensor.device))
        host.copy_(tensor, non_blocking=True)
    stream.synchronize()
    return host


# ---------------------------------------------------------------- wire description
@dataclass(frozen=True)
class IpcDescription:
    pool: str  # "" for a per-transfer export, else the sender pool's random id (receivers cache it)
    device_uuid: str
    handle: bytes
    storage_bytes: int
    storage_offset: int  # of the exported storage inside its cudaMalloc block (torch's offset)
    offset: int  # of the payload inside the exported storage
    event: bytes
    event_sync: bool

    def to_text(self) -> str:
        return json.dumps(
            {
                "v": IPC_VERSION,
                "pool": self.pool,
                "dev": self.device_uuid,
                "handle": self.handle.hex(),
                "size": self.storage_bytes,
                "soff": self.storage_offset,
                "off": self.offset,
                "event": self.event.hex(),
                "sync": self.event_sync,
            },
            separators=(",", ":"),
        )


def _int(d: dict, key: str, lo: int, hi: int) -> int:
    v = d[key]
    if type(v) is not int or not lo <= v <= hi:
        raise IpcError(f"cuda_ipc field {key!r} must be an int in [{lo}, {hi}], got {v!r}")
    return v


def _hex(d: dict, key: str, lo: int, hi: int) -> bytes:
    v = d[key]
    if not isinstance(v, str) or not _HEX.fullmatch(v) or not lo <= len(v) // 2 <= hi:
        raise IpcError(f"cuda_ipc field {key!r} must be lowercase hex of {lo}..{hi} bytes")
    return bytes.fromhex(v)


def check_handle(handle: bytes) -> None:
    """Plain cudaMalloc IPC handles only (see the module docstring)."""
    if len(handle) == CUDA_IPC_HANDLE_SIZE:
        return  # torch before versioned handles: the bare cudaIpcMemHandle_t
    # versioned: [version, type, cudaIpcMemHandle_t ...]; version 2 as of torch 2.x, later ones
    # accepted as long as the type is 'c' (torch reads version, type, then the 64-byte handle)
    if (
        CUDA_IPC_HANDLE_SIZE + 2 <= len(handle) <= _MAX_HANDLE
        and 1 <= handle[0] <= 15
        and handle[1] == _TORCH_HANDLE_CUDA_MALLOC
    ):
        return
    raise IpcError(
        "cuda_ipc handle is not a plain cudaMalloc IPC handle (expandable segments "
        "are refused: set PYTORCH_CUDA_ALLOC_CONF without expandable_segments)"
    )


def parse_description(text: str, nbytes: int) -> IpcDescription:
    """Untrusted text from the wire → IpcDescription, or IpcError. Nothing is opened here."""
    if not isinstance(text, str) or len(text) > 1024:
        raise IpcError("cuda_ipc description missing or too long")
    try:
        d = json.loads(text)
    except ValueError:
        raise IpcError("cuda_ipc description is not JSON") from None
    if not isinstance(d, dict) or set(d) != _KEYS:
        keys = sorted(d) if isinstance(d, dict) else type(d).__name__
        raise IpcError(f"cuda_ipc description keys {keys}, expected {sorted(_KEYS)}")
    if d["v"] != IPC_VERSION or type(d["v"]) is not int:
        raise IpcError(f"cuda_ipc description version {d['v']!r}, this side speaks {IPC_VERSION}")
    pool = d["pool"]
    if not isinstance(pool, str) or (pool and not _POOL_ID.fullmatch(pool)):
        raise IpcError("cuda_ipc field 'pool' must be '' or 32 lowercase hex digits")
    dev = d["dev"]
    if not isinstance(dev, str) or not _UUID.fullmatch(dev):
        raise IpcError("cuda_ipc field 'dev' is not a GPU UUID")
    if not isinstance(d["sync"], bool):
        raise IpcError("cuda_ipc field 'sync' must be a bool")
    handle = _hex(d, "handle", CUDA_IPC_HANDLE_SIZE, _MAX_HANDLE)
    check_handle(handle)
    desc = IpcDescription(
        pool=pool,
        device_uuid=dev,
        handle=handle,
        storage_bytes=_int(d, "size", 1, _MAX_SIZE),
        storage_offset=_int(d, "soff", 0, _MAX_SIZE),
        offset=_int(d, "off", 0, _MAX_SIZE),
        event=_hex(d, "event", CUDA_IPC_HANDLE_SIZE, CUDA_IPC_HANDLE_SIZE),
        event_sync=d["sync"],
    )
    if desc.offset + nbytes > desc.storage_bytes:
        raise IpcError(
            f"cuda_ipc payload [{desc.offset}, {desc.offset + nbytes}) lies outside the "
            f"exported storage of {desc.storage_bytes} bytes"
        )
    return desc


# ---------------------------------------------------------------- sender side
def _share(storage: torch.UntypedStorage) -> tuple[Any, ...]:
    (device, handle, size, soff, ref, ref_off, event, sync) = storage._share_cuda_()
    if handle is None:
        raise IpcError("cannot export an empty CUDA storage")
    check_handle(handle)
    return device, handle, size, soff, ref, ref_off, event, sync


def _release_counter(ref: bytes, ref_off: int) -> None:
    try:
        torch.UntypedStorage._release_ipc_counter_cuda(ref, ref_off)
    except Exception:  # the counter file is gone only when the process is shutting down
        log.debug("releasing a CUDA IPC counter failed", exc_info=True)


class IpcPool:
    """One exported staging buffer on one GPU, carved first-fit; thread-safe."""

    def __init__(self, device: torch.device, nbytes: int):
        self.device = device
        self.nbytes = nbytes
        self.id = secrets.token_hex(16)
        self.buffer: torch.Tensor | None = torch.empty(nbytes, dtype=torch.uint8, device=device)
        (_, self._handle, self._size, self._soff, self._ref, self._ref_off, self._event, self._sync) = _share(
            self.buffer.untyped_storage()
        )
        self._base = int(self.buffer.storage_offset())
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # sorted (offset, size)
        self._lock = threading.Lock()
        self.uuid = gpu_uuid(device)

    def alloc(self, nbytes: int) -> int | None:
        size = max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
        with self._lock:
            for i, (off, free) in enumerate(self._free):
                if free >= size:
                    if free == size:
                        del self._free[i]
                    else:
                        self._free[i] = (off + size, free - size)
                    return off
        return None

    def free(self, offset: int, nbytes: int) -> None:
        size = max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
        with self._lock:
            blocks = self._free
            blocks.append((offset, size))
            blocks.sort()
            merged: list[tuple[int, int]] = []
            for off, sz in blocks:
                if merged and merged[-1][0] + merged[-1][1] == off:
                    merged[-1] = (merged[-1][0], merged[-1][1] + sz)
                else:
                    merged.append((off, sz))
            self._free = merged

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(sz for _, sz in self._free)

    def describe(self, offset: int) -> IpcDescription:
        return IpcDescription(
            pool=self.id,
            device_uuid=self.uuid,
            handle=self._handle,
            storage_bytes=self._size,
            storage_offset=self._soff,
            offset=self._base + offset,
            event=self._event,
            event_sync=bool(self._sync),
        )

    def close(self) -> None:
        if self.buffer is not None:
            _release_counter(self._ref, self._ref_off)
            self.buffer = None


class IpcExport:
    """One staged KV on the GPU: a region of a pool, or its own exported tensor."""

    def __init__(
        self,
        description: IpcDescription,
        *,
        pool: IpcPool | None = None,
        offset: int = 0,
        nbytes: int = 0,
        tensor: torch.Tensor | None = None,
        counter: tuple[bytes, int] | None = None,
    ):
        self.description = description
        self.text = description.to_text()
        self._pool, self._offset, self._nbytes = pool, offset, nbytes
        self._tensor, self._counter = tensor, counter
        self._released = False

    @property
    def in_pool(self) -> bool:
        return self._pool is not None

    def release(self) -> None:
        """Free the staged bytes. Only after the receiver's ACK, or when nobody may pull any more."""
        if self._released:
            return
        self._released = True
        if self._pool is not None:
            self._pool.free(self._offset, self._nbytes)
        if self._counter is not None:
            _release_counter(*self._counter)
        self._tensor = None


def export(tensor: torch.Tensor, ready: torch.cuda.Event | None = None, pool: IpcPool | None = None) -> IpcExport:
    """Stage a contiguous CUDA tensor for a cuda_ipc pull; returns when its bytes are in place."""
    if not tensor.is_cuda or not tensor.is_contiguous():
        raise ValueError("cuda_ipc stages contiguous CUDA tensors only")
    nbytes = tensor.numel() * tensor.element_size()
    stream = side_stream(tensor.device)
    offset = pool.alloc(nbytes) if pool is not None and nbytes > 0 else None
    with torch.cuda.stream(stream):
        if ready is not None:
            stream.wait_event(ready)
        else:
            stream.wait_stream(torch.cuda.default_stream(tensor.device))
        if offset is not None and pool is not None and pool.buffer is not None:
            try:
                pool.buffer[offset : offset + nbytes].copy_(tensor.reshape(-1).view(torch.uint8), non_blocking=True)
            except BaseException:
                pool.free(offset, nbytes)
                raise
            stream.synchronize()  # in place before any PULL can be answered; `tensor` may go
            return IpcExport(pool.describe(offset), pool=pool, offset=offset, nbytes=nbytes)
        # own export: the IPC event recorded by _share_cuda_ on this stream orders the receiver
        storage = tensor.untyped_storage()
        (_, handle, size, soff, ref, ref_off, event, sync) = _share(storage)
    stream.synchronize()
    desc = IpcDescription(
        pool="",
        device_uuid=gpu_uuid(tensor.device),
        handle=handle,
        storage_bytes=size,
        storage_offset=soff,
        offset=int(tensor.storage_offset()) * tensor.element_size(),
        event=event,
        event_sync=bool(sync),
    )
    return IpcExport(desc, tensor=tensor, counter=(ref, ref_off))


# ---------------------------------------------------------------- receiver side
class IpcImporter:
    """Opens descriptions and copies them into tensors on `device`. Thread-safe."""

    def __init__(self, device: torch.device | str | None):
        self.device = torch.device(device) if device is not None else None
        if self.device is not None and self.device.type != "cuda":
            self.device = None
        if self.device is not None and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[tuple, torch.UntypedStorage] = collections.OrderedDict()
        self._sink: torch.Tensor | None = None
        self._sink_ref: tuple[bytes, int] | None = None

    def _sink_counter(self, device_index: int) -> tuple[bytes, int]:
        """A counter slot of our own for torch's consumer-side decrement (module docstring)."""
        with self._lock:
            if self._sink_ref is None:
                self._sink = torch.empty(1, dtype=torch.uint8, device=f"cuda:{device_index}")
                share = self._sink.untyped_storage()._share_cuda_()
                self._sink_ref = (share[4], share[5])
            return self._sink_ref

    def _open(self, desc: IpcDescription, src: int) -> torch.UntypedStorage:
        key = (desc.pool, desc.handle, desc.storage_offset, desc.storage_bytes) if desc.pool else None
        if key is not None:
            with self._lock:
                storage = self._cache.get(key)
                if storage is not None:
                    self._cache.move_to_end(key)
                    return storage
        ref, ref_off = self._sink_counter(src)
        try:
            storage = torch.UntypedStorage._new_shared_cuda(
                src, desc.handle, desc.storage_bytes, desc.storage_offset, ref, ref_off, desc.event, desc.event_sync
            )
        except Exception as exc:  # RuntimeError from CUDA (bad handle, foreign GPU, ...)
            raise IpcError(f"opening the CUDA IPC handle failed: {exc}".splitlines()[0]) from None
        if storage.nbytes() != desc.storage_bytes:
            raise IpcError(f"opened storage has {storage.nbytes()} bytes, described {desc.storage_bytes}")
        if key is not None:
            with self._lock:
                self._cache[key] = storage
                while len(self._cache) > _RECEIVER_CACHE:
                    self._cache.popitem(last=False)
        return storage

    def forget(self, desc: IpcDescription) -> None:
        with self._lock:
            self._cache.pop((desc.pool, desc.handle, desc.storage_offset, desc.storage_bytes), None)

    def copy(
        self, desc: IpcDescription, dtype: torch.dtype, shape: tuple[int, ...], out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Device-to-device copy of the described bytes into `out` (or a new tensor on our
        device); returns once the copy has finished and what was opened for it is closed."""
        return self.start_copy(desc, dtype, shape, out).wait()

    def start_copy(
        self, desc: IpcDescription, dtype: torch.dtype, shape: tuple[int, ...], out: torch.Tensor | None = None
    ) -> PendingCopy:
        """Queue the copy on a side stream and return at once; ``wait()`` finishes it. Lets the
        receiver overlap the copy with the control round trip (receiver.py)."""
        if self.device is None:
            raise IpcError("this receiver has no CUDA device to copy a cuda_ipc payload into")
        src = local_index(desc.device_uuid)
        if src is None:
            raise IpcError(f"GPU {desc.device_uuid} is not visible to this process")
        nbytes = 1
        for d in shape:
            nbytes *= d
        nbytes *= dtype.itemsize
        dst_dev = self.device
        stream = side_stream(dst_dev)
        with torch.cuda.device(dst_dev), torch.cuda.stream(stream):
            storage = self._open(desc, src)
            try:
                flat = torch.empty(0, dtype=torch.uint8, device=f"cuda:{src}")
                flat.set_(storage, 0, (storage.nbytes(),), (1,))
                payload = flat[desc.offset : desc.offset + nbytes]
                if out is None:
                    out = torch.empty(shape, dtype=dtype, device=dst_dev)
                # cudaMemcpy; an SM copy kernel (bitwise_or into int64) measured no faster on the
                # H200 (bench/baselines/h200*/kv-transfer-gpu.json)
                out.view(-1).view(torch.uint8).copy_(payload, non_blocking=True)
            except Exception as exc:
                if desc.pool:
                    self.forget(desc)
                raise IpcError(f"cuda_ipc copy failed: {exc}".splitlines()[0]) from None
            done = torch.cuda.Event()
            done.record(stream)
        return PendingCopy(self, desc, out, done, src, dst_dev, (storage, flat, payload))

    def close(self) -> None:
        with self._lock:
            self._cache.clear()


class PendingCopy:
    """A queued cuda_ipc copy; ``wait()`` returns the tensor once the copy has finished."""

    def __init__(
        self,
        importer: IpcImporter,
        desc: IpcDescription,
        out: torch.Tensor,
        done: torch.cuda.Event,
        src: int,
        dst_dev: torch.device,
        refs: tuple,
    ):
        self._importer, self._desc, self.out, self._done = importer, desc, out, done
        self._src, self._dst_dev = src, dst_dev
        self._refs: tuple | None = refs

    def wait(self) -> torch.Tensor:
        if self._refs is None:
            return self.out
        try:
            self._done.synchronize()
            if self._src != self._dst_dev.index:
                torch.cuda.current_stream(self._src).synchronize()
        except Exception as exc:
            if self._desc.pool:
                self._importer.forget(self._desc)
            raise IpcError(f"cuda_ipc copy failed: {exc}".splitlines()[0]) from None
        finally:  # a per-transfer mapping closes when its last reference goes, here
            self._refs = None
        # `out` was written on our side stream; the engine uses it on its default stream
        self.out.record_stream(torch.cuda.default_stream(self._dst_dev))
        return self.out

    def discard(self) -> None:
        """Let the copy finish and drop it (its bytes are not used)."""
        try:
            self.wait()
        except IpcError:
            log.debug("a discarded cuda_ipc copy failed", exc_info=True)
