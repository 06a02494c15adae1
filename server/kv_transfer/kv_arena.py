"""A decode worker's KV pool as one allocation another process on the same device can map.

KV hand-off by reference (``by_reference.py``) needs the prefill worker to write a prompt's KV
straight into the decode worker's blocks, so the decode worker allocates its whole pool (every
layer's ``[2, num_blocks * block_size, kv_heads, head_dim]`` cache, as in ``model_runner.py``) as
one buffer and *exports* it:

- on CUDA: one ``cudaMalloc`` block, exported with torch's CUDA IPC (``_share_cuda_``, as the
  ``cuda_ipc`` copy path exports its staging pool); the description is ``cuda_ipc``'s JSON text;
- on the CPU: a POSIX shared-memory segment (``shm.create_segment``: a random name carrying the
  owner's pid, so the next start removes it when the owner was killed).

The peer maps it read-write (``ArenaMapping``) and checks the layout against its own model before
it writes anything: layers, block size, KV heads, head dim and dtype must be equal (block count
is the owner's). Descriptions are JSON with an exact key set and ranges, parsed by
``ArenaDescription.from_dict``; nothing is unpickled. The arena id is random per owner
incarnation: a restarted decode worker has a new one, so a mapping of the dead one's is never
mistaken for it.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
from dataclasses import dataclass
from typing import Any

import torch

from . import cuda_ipc
from .frame import DTYPE_NAMES
from .shm import SEGMENT_NAME_RE, create_segment, destroy_segment

try:
    import _posixshmem
except ImportError:  # pragma: no cover - non-POSIX
    _posixshmem = None

ARENA_PREFIX = "dskvarena"  # shm names: dskvarena<pid>_<32 hex> (server/preflight.py sweeps orphans by prefix)
_ID = re.compile(r"[0-9a-f]{32}")
_MAX = 1 << 46
KINDS = ("shm", "cuda_ipc")


class ArenaError(ValueError):
    """The arena cannot be created, described, mapped or used (failures are data for the caller)."""


def _int(d: dict, key: str, lo: int, hi: int) -> int:
    v = d.get(key)
    if type(v) is not int or not lo <= v <= hi:
        raise ArenaError(f"KV arena field {key!r} must be an int in [{lo}, {hi}], got {v!r}")
    return v


@dataclass(frozen=True)
class ArenaLayout:
    num_layers: int
    num_blocks: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: str  # a name of frame.DTYPE_NAMES

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPE_NAMES[self.dtype]

    @property
    def nbytes(self) -> int:
        n = self.num_layers * 2 * self.num_blocks * self.block_size * self.kv_heads * self.head_dim
        return n * self.torch_dtype.itemsize

    def same_shape(self, other: ArenaLayout) -> str | None:
        """None when a KV written by one fits the other (block count aside), else why not."""
        for name in ("num_layers", "block_size", "kv_heads", "head_dim", "dtype"):
            if getattr(self, name) != getattr(other, name):
                return f"{name} {getattr(self, name)} != {getattr(other, name)}"
        return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_layers": self.num_layers,
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
        }

    @classmethod
    def from_dict(cls, d: Any) -> ArenaLayout:
        keys = {"num_layers", "num_blocks", "block_size", "kv_heads", "head_dim", "dtype"}
        if not isinstance(d, dict) or set(d) != keys:
            raise ArenaError(f"KV arena layout keys must be {sorted(keys)}")
        dtype = d["dtype"]
        if not isinstance(dtype, str) or dtype not in DTYPE_NAMES:
            raise ArenaError(f"KV arena dtype {dtype!r} unknown")
        layout = cls(
            num_layers=_int(d, "num_layers", 1, 4096),
            num_blocks=_int(d, "num_blocks", 1, 1 << 32),
            block_size=_int(d, "block_size", 1, 1 << 16),
            kv_heads=_int(d, "kv_heads", 1, 1 << 12),
            head_dim=_int(d, "head_dim", 1, 1 << 14),
            dtype=dtype,
        )
        if layout.nbytes > _MAX:
            raise ArenaError(f"KV arena of {layout.nbytes} bytes is larger than any device")
        return layout


@dataclass(frozen=True)
class ArenaDescription:
    arena_id: str
    kind: str  # "shm" | "cuda_ipc"
    layout: ArenaLayout
    shm_name: str = ""  # kind shm
    ipc: str = ""  # kind cuda_ipc: cuda_ipc.IpcDescription text of the whole buffer

    def to_dict(self) -> dict[str, Any]:
        return {
            "arena_id": self.arena_id,
            "kind": self.kind,
            "layout": self.layout.to_dict(),
            "shm_name": self.shm_name,
            "ipc": self.ipc,
        }

    @classmethod
    def from_dict(cls, d: Any) -> ArenaDescription:
        keys = {"arena_id", "kind", "layout", "shm_name", "ipc"}
        if not isinstance(d, dict) or set(d) != keys:
            raise ArenaError(f"KV arena description keys must be {sorted(keys)}")
        aid, kind, name, ipc = d["arena_id"], d["kind"], d["shm_name"], d["ipc"]
        if not isinstance(aid, str) or not _ID.fullmatch(aid):
            raise ArenaError("KV arena id must be 32 lowercase hex digits")
        if kind not in KINDS:
            raise ArenaError(f"KV arena kind {kind!r}, expected one of {KINDS}")
        layout = ArenaLayout.from_dict(d["layout"])
        if kind == "shm":
            if not isinstance(name, str) or not SEGMENT_NAME_RE.fullmatch(name) or ipc != "":
                raise ArenaError("KV arena of kind shm needs a valid shm_name and no ipc")
        else:
            if name != "" or not isinstance(ipc, str) or not 0 < len(ipc) <= 1024:
                raise ArenaError("KV arena of kind cuda_ipc needs an ipc description and no shm_name")
            cuda_ipc.parse_description(ipc, layout.nbytes)  # validated here, opened only by ArenaMapping
        return cls(aid, kind, layout, name, ipc)


def layout_for(model_config, num_blocks: int, block_size: int, dtype: torch.dtype) -> ArenaLayout:
    """The arena layout of a model runner's cache (``model_runner.py``)."""
    names = {v: k for k, v in DTYPE_NAMES.items()}
    if dtype not in names:
        raise ArenaError(f"a KV cache of {dtype} cannot be described")
    return ArenaLayout(
        model_config.num_hidden_layers,
        num_blocks,
        block_size,
        model_config.num_key_value_heads,
        model_config.head_dim,
        names[dtype],
    )


def _views(flat: torch.Tensor, layout: ArenaLayout) -> torch.Tensor:
    """``[layers, 2, blocks * block_size, kv_heads, head_dim]`` over a uint8 buffer."""
    shape = (layout.num_layers, 2, layout.num_blocks * layout.block_size, layout.kv_heads, layout.head_dim)
    return flat[: layout.nbytes].view(layout.torch_dtype).view(shape)


class ArenaOwner:
    """The decode worker's pool in exportable memory; ``tensor`` is what its model runner caches in."""

    def __init__(self, layout: ArenaLayout, device: torch.device) -> None:
        self.layout = layout
        self.device = device
        self.arena_id = secrets.token_hex(16)
        self._segment = None
        self._ipc_ref: tuple[bytes, int] | None = None
        if device.type == "cuda":
            flat = torch.zeros(layout.nbytes, dtype=torch.uint8, device=device)
            try:
                (_, handle, size, soff, ref, ref_off, event, sync) = cuda_ipc._share(flat.untyped_storage())
            except (cuda_ipc.IpcError, RuntimeError) as e:
                raise ArenaError(f"the KV pool cannot be exported over CUDA IPC: {e}") from None
            self._ipc_ref = (ref, ref_off)
            desc = cuda_ipc.IpcDescription(
                pool=self.arena_id,
                device_uuid=cuda_ipc.gpu_uuid(device),
                handle=handle,
                storage_bytes=size,
                storage_offset=soff,
                offset=int(flat.storage_offset()),
                event=event,
                event_sync=bool(sync),
            )
            self.description = ArenaDescription(self.arena_id, "cuda_ipc", layout, ipc=desc.to_text())
        else:
            try:
                self._segment = create_segment(layout.nbytes, prefix=ARENA_PREFIX)
            except OSError as e:
                raise ArenaError(f"no shared memory for the KV pool ({layout.nbytes} bytes): {e}") from None
            flat = torch.frombuffer(self._segment.buf, dtype=torch.uint8, count=layout.nbytes)
            self.description = ArenaDescription(self.arena_id, "shm", layout, shm_name=self._segment.name)
        self.flat: torch.Tensor | None = flat
        self.tensor: torch.Tensor | None = _views(flat, layout)

    def close(self) -> None:
        """Unlink the segment / release the IPC counter; mappings of peers stay valid until they close."""
        self.tensor = self.flat = None
        if self._ipc_ref is not None:
            cuda_ipc._release_counter(*self._ipc_ref)
            self._ipc_ref = None
        if self._segment is not None:
            seg, self._segment = self._segment, None
            try:
                destroy_segment(seg)
            except BufferError:  # a tensor view still alive: unlink anyway (the mapping goes at exit)
                with contextlib.suppress(FileNotFoundError):
                    seg.unlink()


class ArenaMapping:
    """A peer's read-write mapping of an owner's arena, checked against this process's own layout."""

    def __init__(self, desc: ArenaDescription, local: ArenaLayout, device: torch.device) -> None:
        why = desc.layout.same_shape(local)
        if why:
            raise ArenaError(f"the decode worker's KV pool does not match this model's ({why})")
        self.description = desc
        self._mmap: mmap.mmap | None = None
        self._storage = None
        if desc.kind == "shm":
            if device.type != "cpu":
                raise ArenaError("a shared-memory KV pool is for CPU workers")
            if _posixshmem is None:  # pragma: no cover
                raise ArenaError("POSIX shared memory is not available")
            try:
                fd = _posixshmem.shm_open("/" + desc.shm_name, os.O_RDWR, mode=0o600)
            except OSError as e:
                raise ArenaError(f"opening the KV pool segment failed: {e}") from None
            try:
                if os.fstat(fd).st_size < desc.layout.nbytes:
                    raise ArenaError("the KV pool segment is smaller than its layout")
                self._mmap = mmap.mmap(fd, desc.layout.nbytes, flags=mmap.MAP_SHARED)
            finally:
                os.close(fd)
            flat = torch.frombuffer(self._mmap, dtype=torch.uint8, count=desc.layout.nbytes)
        else:
            if device.type != "cuda":
                raise ArenaError("a CUDA KV pool needs a CUDA worker")
            ipc = cuda_ipc.parse_description(desc.ipc, desc.layout.nbytes)
            src = cuda_ipc.local_index(ipc.device_uuid)
            if src is None or src != (device.index if device.index is not None else torch.cuda.current_device()):
                raise ArenaError("the decode worker's KV pool is on another GPU (by reference needs the same one)")
            self._importer = cuda_ipc.IpcImporter(device)
            try:
                storage = self._importer._open(ipc, src)
            except cuda_ipc.IpcError as e:
                raise ArenaError(str(e)) from None
            self._storage = storage
            base = torch.empty(0, dtype=torch.uint8, device=device)
            base.set_(storage, 0, (storage.nbytes(),), (1,))
            flat = base[ipc.offset : ipc.offset + desc.layout.nbytes]
        self.tensor: torch.Tensor | None = _views(flat, desc.layout)

    @property
    def arena_id(self) -> str:
        return self.description.arena_id

    def write(self, block_ids: list[int], kv: torch.Tensor) -> None:
        """Write ``gather_kv``-layout KV (``[layers, 2, tokens, heads, dim]``) into the slots of ``block_ids``."""
        t = self.tensor
        if t is None:
            raise ArenaError("the KV pool mapping is closed")
        bs = self.description.layout.block_size
        n = kv.shape[2]
        if len(block_ids) != -(-n // bs):
            raise ArenaError(f"{len(block_ids)} blocks for {n} tokens of block size {bs}")
        table = torch.tensor(block_ids, dtype=torch.long)
        slots = (table[:, None] * bs + torch.arange(bs)).reshape(-1)[:n].to(t.device, non_blocking=True)
        for layer in range(t.shape[0]):
            t[layer].index_copy_(1, slots, kv[layer].to(t.dtype))

    def close(self) -> None:
        self.tensor = None
        self._storage = None
        if self._mmap is not None:
            m, self._mmap = self._mmap, None
            with contextlib.suppress(BufferError):
                m.close()
