"""Prefill-side staging server: holds KV under a lease and serves authenticated pulls over TCP.

One listener thread accepts connections; each connection is served by a thread from a pool —
pooled because starting a thread costs ~1.5 ms on the Firecracker VMs we run on, more than pulling a
1 MiB payload. A connection is persistent: its thread serves PULLs one after another (protocol in
frame.py) until the receiver closes it, `idle_timeout_s` passes without a frame, the stream gets out
of sync (bad frame, a failed send), or the server closes. So a receiver that keeps its connection
open pays neither the connect nor the hand-off to a pool thread per pull: only PULL -> reply and
ACK -> DONE. At most `max_connections` are open, at most `max_connections_per_peer` from one
address. A connection is *authenticated* once it has presented a valid secret for a staged entry;
until then it holds nothing but its socket and thread, must deliver each request frame within
`handshake_timeout_s` of the frame's first byte, and is the first to be closed when a new
connection needs room (then the one idle the longest; a receiver's pool must not lock out other
receivers). When none can be closed, the new one is refused. So a local process that opens many
connections and stalls cannot starve real pulls. Per transport:

- tcp: DATA_INLINE header, then the tensor's bytes straight from its memory (no copy), chunked so a
  slow reader is bounded by `io_timeout_s` per chunk, not per payload;
- shm: the bytes were copied into a fresh POSIX segment at stage time; the reply is DATA_SHM with
  the segment's (random) name, and the receiver copies out of it;
- cuda_ipc: the KV stays on the GPU (in the staging pool, or the tensor itself); the reply is
  DATA_CUDA_IPC with a JSON description of its CUDA IPC handle, and the receiver copies GPU to GPU
  (cuda_ipc.py).

Either way the entry is unstaged only when the receiver ACKs — a receiver error (checksum mismatch,
crash) leaves it staged so decode can retry until the lease ends. After an ACK the sender unstages
the entry, answers DONE, and hands the memory to a freeing thread (unlinking and unmapping a
256 MiB segment takes ~100 ms here, which neither this pull nor the next one on the connection
should wait for). A sweeper thread frees entries whose lease ended, so a decode worker that never
comes cannot leak prefill memory.
"""

from __future__ import annotations

import collections
import hmac
import logging
import secrets
import socket
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory
from typing import TYPE_CHECKING

import torch

from .base import KVHandle, KVSender, TransferStatus, check_kv_scales
from .factory import host_id as this_host_id
from .frame import (
    DTYPE_CODES,
    MAX_NDIM,
    MAX_REQUEST_ID_BYTES,
    ErrorCode,
    Frame,
    FrameError,
    FrameType,
    dtype_name,
    encode_frame,
    read_frame,
    tensor_bytes,
)
from .shm import DEFAULT_PREFIX, create_segment, destroy_segment

if TYPE_CHECKING:
    from .cuda_ipc import IpcExport, IpcPool

logger = logging.getLogger(__name__)

_HISTORY_SIZE = 4096  # terminal statuses remembered for poll() and for EXPIRED-vs-unknown replies
_MIN_SWEEP_S, _MAX_SWEEP_S = 0.005, 0.1


class StagingFullError(RuntimeError):
    """Staging would exceed max_staged_bytes: back-pressure for the prefill scheduler."""


@dataclass
class SenderStats:
    bytes_sent: int = 0  # payload bytes of successful (ACKed) transfers, both transports
    transfers_ok: int = 0
    transfers_failed: int = 0  # pull attempts that did not end in an ACK
    transfers_expired: int = 0
    transfers_aborted: int = 0
    auth_failures: int = 0  # pulls with a wrong secret
    connections_accepted: int = 0  # control connections taken on (each serves any number of pulls)
    connections_refused: int = 0  # closed at once: max_connections open, none of them idle
    connections_evicted: int = 0  # unauthenticated or idle connections closed to make room for a new one
    handshake_timeouts: int = 0  # connections closed for sending a request frame too slowly


@dataclass(eq=False)
class _Entry:
    request_id: str
    transport: str
    secret: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    checksum: int | None
    lease_s: float
    expiry: float
    tensor: torch.Tensor | None = None  # tcp
    segment: SharedMemory | None = None  # shm
    ipc: IpcExport | None = None  # cuda_ipc
    in_flight: bool = False


def _payload(entry: _Entry) -> torch.Tensor | str | None:
    """What a PULL of this entry sends: the tensor (tcp), or the name that lets the receiver map it."""
    if entry.transport == "tcp":
        return entry.tensor
    if entry.transport == "cuda_ipc":
        return entry.ipc.text if entry.ipc is not None else None
    return entry.segment.name if entry.segment is not None else None


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    idle_since: float | None  # monotonic; None while a PULL is being served
    peer: str = ""
    opened: float = 0.0
    authenticated: bool = False  # presented a valid secret at least once
    evicted: bool = False  # shut down to make room; its thread is on its way out


# outcomes of sending one entry
_ACKED, _RECEIVER_ERROR, _OUT_OF_SYNC = "acked", "receiver error", "out of sync"


class KVStagingServer(KVSender):
    """KVSender over a TCP listener (bind 127.0.0.1 by default; port 0 = ephemeral)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        advertise_host: str | None = None,
        default_lease_ms: float = 30_000.0,
        checksum: bool = True,
        io_timeout_s: float = 30.0,
        max_staged_bytes: int | None = None,
        max_connections: int = 64,
        shm_prefix: str = DEFAULT_PREFIX,
        chunk_bytes: int = 8 << 20,
        cuda_ipc_pool_bytes: int = 0,
        idle_timeout_s: float | None = 60.0,
        handshake_timeout_s: float = 2.0,
        max_connections_per_peer: int | None = None,
    ):
        """`idle_timeout_s`: close a connection that has waited this long for its next PULL
        (None: never); `handshake_timeout_s` bounds reading a request frame once its first byte
        came; `io_timeout_s` bounds each read/write of the payload exchange after it."""
        if default_lease_ms <= 0:
            raise ValueError(f"default_lease_ms must be > 0, got {default_lease_ms}")
        if idle_timeout_s is not None and idle_timeout_s <= 0:
            raise ValueError(f"idle_timeout_s must be > 0 or None, got {idle_timeout_s}")
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        if handshake_timeout_s <= 0:
            raise ValueError(f"handshake_timeout_s must be > 0, got {handshake_timeout_s}")
        self.handshake_timeout_s = handshake_timeout_s
        self.max_connections_per_peer = min(max_connections, max_connections_per_peer or max_connections)
        self.default_lease_ms = float(default_lease_ms)
        self.checksum = checksum
        self.io_timeout_s = io_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.max_staged_bytes = max_staged_bytes
        self.max_connections = max_connections
        self.shm_prefix = shm_prefix
        self.chunk_bytes = chunk_bytes
        self.cuda_ipc_pool_bytes = cuda_ipc_pool_bytes  # per GPU; 0 = export each tensor itself
        self._ipc_pools: dict[int, IpcPool] = {}
        self.host_id = this_host_id()
        self.stats = SenderStats()

        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._history: collections.OrderedDict[str, TransferStatus] = collections.OrderedDict()
        self._conns: dict[socket.socket, _Conn] = {}
        self._pool = ThreadPoolExecutor(max_workers=max_connections, thread_name_prefix="kv-conn")
        # frees the memory of ACKed entries off the connection threads (its thread starts lazily)
        self._freer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-free")
        self._stop = threading.Event()
        self._closed = False

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=128)
        self.port = self._listener.getsockname()[1]
        adv = advertise_host or (socket.gethostname() if host in ("", "0.0.0.0", "::") else host)
        self.address = f"[{adv}]:{self.port}" if ":" in adv else f"{adv}:{self.port}"

        self._threads = [
            threading.Thread(target=self._accept_loop, name="kv-accept", daemon=True),
            threading.Thread(target=self._sweep_loop, name="kv-sweep", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # ---------------------------------------------------------------- KVSender
    def stage(
        self,
        request_id: str,
        tensor: torch.Tensor,
        lease_ms: float | None = None,
        *,
        transport: str = "tcp",
        checksum: bool | None = None,
        ready_event=None,
        kv_scales: tuple[tuple[float, float], ...] = (),
    ) -> KVHandle:
        """Stage `tensor` for one pull (an FP8 tensor with its per-layer `kv_scales`, which the handle
        carries). Takes ownership: do not modify it afterwards (tcp sends
        straight from its memory). Raises ValueError for bad arguments, StagingFullError.
        cuda_ipc: `tensor` is on a GPU; `ready_event` (a CUDA event recorded after the work that
        wrote it) saves waiting for everything queued on its device; no checksum (the bytes never
        reach the host)."""
        self._check_stage_args(request_id, tensor, transport)
        check_kv_scales(kv_scales, dtype_name(tensor.dtype), tuple(tensor.shape))  # before anything is held
        lease_ms = self.default_lease_ms if lease_ms is None else float(lease_ms)
        if lease_ms <= 0:
            raise ValueError(f"lease_ms must be > 0, got {lease_ms}")
        tensor = tensor.detach()
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        with self._lock:
            self._check_capacity(request_id, nbytes)
        if transport == "cuda_ipc":
            return self._stage_ipc(request_id, tensor, nbytes, lease_ms, ready_event, kv_scales)
        use_crc = self.checksum if checksum is None else checksum
        segment: SharedMemory | None = None
        held: torch.Tensor | None = tensor
        if transport == "shm":
            segment, held = create_segment(nbytes, self.shm_prefix), None
        try:
            src = tensor_bytes(tensor)
            if segment is not None:
                buf = segment.buf
                if buf is None:
                    raise RuntimeError(f"shm segment {segment.name} has no buffer")
                buf[:nbytes] = src
                src = buf[:nbytes]
            crc = zlib.crc32(src) if use_crc else None
            src.release()
        except BaseException:
            if segment is not None:
                destroy_segment(segment)
            raise
        lease_s = lease_ms / 1000.0
        entry = _Entry(
            request_id=request_id,
            transport=transport,
            secret=secrets.token_hex(16),
            dtype=tensor.dtype,
            shape=tuple(tensor.shape),
            nbytes=nbytes,
            checksum=crc,
            lease_s=lease_s,
            expiry=time.monotonic() + lease_s,
            tensor=held,
            segment=segment,
        )
        return self._register(entry, kv_scales)

    def ipc_pool(self, device: torch.device):
        """The cuda_ipc staging pool of ``device``, allocated on first use (a worker calls this at start,
        so the pool is part of its memory budget instead of a first transfer's surprise); None when
        there is none (disabled, or it could not be allocated: each KV tensor is then exported itself)."""
        from . import cuda_ipc

        if self.cuda_ipc_pool_bytes <= 0:
            return None
        index = device.index if device.index is not None else torch.cuda.current_device()
        with self._lock:
            pool = self._ipc_pools.get(index)
        if pool is None:
            try:
                pool = cuda_ipc.IpcPool(torch.device("cuda", index), self.cuda_ipc_pool_bytes)
            except Exception as exc:  # out of memory, or memory that cannot be exported
                logger.warning(
                    "cuda_ipc staging pool of %d bytes unavailable (%s); exporting each KV tensor itself",
                    self.cuda_ipc_pool_bytes,
                    exc,
                )
                self.cuda_ipc_pool_bytes = 0
                return None
            with self._lock:
                pool = self._ipc_pools.setdefault(index, pool)
        return pool

    def _stage_ipc(
        self, request_id: str, tensor: torch.Tensor, nbytes: int, lease_ms: float, ready_event, kv_scales=()
    ) -> KVHandle:
        from . import cuda_ipc

        pool = None
        if self.cuda_ipc_pool_bytes > 0 and nbytes <= self.cuda_ipc_pool_bytes:
            pool = self.ipc_pool(tensor.device)
        dtype, shape = tensor.dtype, tuple(tensor.shape)
        export = cuda_ipc.export(tensor, ready_event, pool)
        del tensor  # a pooled export copied it; an own export holds it
        lease_s = lease_ms / 1000.0
        entry = _Entry(
            request_id=request_id,
            transport="cuda_ipc",
            secret=secrets.token_hex(16),
            dtype=dtype,
            shape=shape,
            nbytes=nbytes,
            checksum=None,
            lease_s=lease_s,
            expiry=time.monotonic() + lease_s,
            ipc=export,
        )
        return self._register(entry, kv_scales)

    def _register(self, entry: _Entry, kv_scales: tuple[tuple[float, float], ...] = ()) -> KVHandle:
        with self._lock:
            try:
                if self._closed:
                    raise RuntimeError("KVStagingServer is closed")
                self._check_capacity(entry.request_id, entry.nbytes)
            except Exception:
                self._free_resources(entry)
                raise
            self._entries[entry.request_id] = entry
            self._history.pop(entry.request_id, None)
        return KVHandle(
            request_id=entry.request_id,
            transport=entry.transport,
            address=self.address,
            secret=entry.secret,
            nbytes=entry.nbytes,
            shape=entry.shape,
            dtype=dtype_name(entry.dtype),
            checksum=entry.checksum,
            host_id=self.host_id,
            ipc=entry.ipc.text if entry.ipc is not None and entry.ipc.in_pool else "",
            kv_scales=kv_scales,
        )

    def abort(self, request_id: str) -> bool:
        return self._finish(request_id, TransferStatus.ABORTED)

    def abort_handle(self, handle: KVHandle) -> bool:
        """Cancel the entry ``handle`` names, if it is still staged and still that one (not a later staging
        under the same request id); True if it was."""
        with self._lock:
            entry = self._entries.get(handle.request_id)
        if entry is None or not hmac.compare_digest(entry.secret, handle.secret):
            return False
        return self._finish(handle.request_id, TransferStatus.ABORTED, only=entry)

    def poll(self, request_id: str) -> TransferStatus | None:
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is not None:
                return TransferStatus.TRANSFERRING if entry.in_flight else TransferStatus.PENDING
            return self._history.get(request_id)

    @property
    def num_staged(self) -> int:
        with self._lock:
            return len(self._entries)

    @property
    def staged_bytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._entries.values())

    @property
    def num_connections(self) -> int:
        """Control connections open now (serving a PULL or waiting for the next one)."""
        with self._lock:
            return sum(not c.evicted for c in self._conns.values())

    @property
    def num_idle_connections(self) -> int:
        """Control connections between pulls: the ones a new connection over ``max_connections`` may evict."""
        with self._lock:
            return sum(not c.evicted and c.idle_since is not None for c in self._conns.values())

    def close(self) -> None:
        """Stop threads, close sockets, unlink every shm segment this server created."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._stop.set()
            conns = list(self._conns)
            # under the lock: a connection's thread closes its socket only after leaving _conns
            for sock in [self._listener, *conns]:
                _shutdown(sock)
        self._listener.close()
        for t in self._threads:
            t.join(timeout=5.0)
        self._pool.shutdown(wait=True, cancel_futures=True)
        for sock in conns:  # those whose task was cancelled before it ran
            sock.close()
        self._freer.shutdown(wait=True)  # no connection thread is left to hand it more
        with self._lock:
            entries, self._entries = list(self._entries.values()), {}
        for entry in entries:
            self._free_resources(entry)
        with self._lock:
            pools, self._ipc_pools = list(self._ipc_pools.values()), {}
        for pool in pools:
            pool.close()

    # ---------------------------------------------------------------- internals
    def _check_stage_args(self, request_id: str, tensor: torch.Tensor, transport: str) -> None:
        if self._closed:
            raise RuntimeError("KVStagingServer is closed")
        if not isinstance(request_id, str) or not 0 < len(request_id.encode()) <= MAX_REQUEST_ID_BYTES:
            raise ValueError(f"request_id must be a str of 1..{MAX_REQUEST_ID_BYTES} UTF-8 bytes")
        if transport not in ("tcp", "shm", "cuda_ipc"):
            raise ValueError(f"transport must be 'tcp', 'shm' or 'cuda_ipc', got {transport!r}")
        want = "cuda" if transport == "cuda_ipc" else "cpu"
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != want:
            raise ValueError(f"KV payload for transport {transport} must be a {want.upper()} torch.Tensor")
        if tensor.dtype not in DTYPE_CODES:
            raise ValueError(f"unsupported KV dtype {tensor.dtype}")
        if tensor.dim() > MAX_NDIM:
            raise ValueError(f"KV tensor has {tensor.dim()} dims, limit {MAX_NDIM}")

    def _check_capacity(self, request_id: str, nbytes: int) -> None:  # under lock
        if request_id in self._entries:
            raise ValueError(f"request {request_id!r} is already staged")
        if self.max_staged_bytes is not None:
            used = sum(e.nbytes for e in self._entries.values())
            if used + nbytes > self.max_staged_bytes:
                raise StagingFullError(
                    f"staging {nbytes} bytes would exceed max_staged_bytes={self.max_staged_bytes} ({used} in use)"
                )

    @staticmethod
    def _free_resources(entry: _Entry) -> None:
        entry.tensor = None
        if entry.ipc is not None:
            entry.ipc.release()
            entry.ipc = None
        if entry.segment is not None:
            destroy_segment(entry.segment)
            entry.segment = None

    def _remember(self, request_id: str, status: TransferStatus) -> None:  # under lock
        self._history[request_id] = status
        self._history.move_to_end(request_id)
        while len(self._history) > _HISTORY_SIZE:
            self._history.popitem(last=False)

    def _finish(self, request_id: str, status: TransferStatus, count: bool = True, only: _Entry | None = None) -> bool:
        """Remove an entry (if still staged, and still `only` when given) and free it."""
        entry = self._unstage(request_id, status, count, only)
        if entry is None:
            return False
        self._free_resources(entry)
        return True

    def _unstage(
        self, request_id: str, status: TransferStatus, count: bool = True, only: _Entry | None = None
    ) -> _Entry | None:
        """Bookkeeping half of _finish: the caller frees the returned entry's memory."""
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is None or (only is not None and entry is not only):
                return None
            del self._entries[request_id]
            self._remember(request_id, status)
            if count and status is TransferStatus.SUCCESS:
                self.stats.transfers_ok += 1
                self.stats.bytes_sent += entry.nbytes
            elif count and status is TransferStatus.EXPIRED:
                self.stats.transfers_expired += 1
            elif count and status is TransferStatus.ABORTED:
                self.stats.transfers_aborted += 1
        return entry

    def _sweep_loop(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            with self._lock:
                expired = [e for e in self._entries.values() if e.expiry <= now and not e.in_flight]
                min_lease = min((e.lease_s for e in self._entries.values()), default=_MAX_SWEEP_S * 4)
            for entry in expired:
                if self._finish(entry.request_id, TransferStatus.EXPIRED, only=entry):
                    logger.info("KV lease expired for request %s", entry.request_id)
            self._stop.wait(min(_MAX_SWEEP_S, max(_MIN_SWEEP_S, min_lease / 4)))

    def _free_later(self, entry: _Entry) -> None:
        try:
            self._freer.submit(self._free_resources, entry)
        except RuntimeError:  # close() has shut the freer down
            self._free_resources(entry)

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, addr = self._listener.accept()
            except OSError:
                if self._stop.is_set():
                    return
                time.sleep(0.01)
                continue
            peer = addr[0] if isinstance(addr, tuple) else str(addr)
            with self._lock:
                if self._closed:
                    conn.close()
                    continue
                live = [c for c in self._conns.values() if not c.evicted]
                same_peer = [c for c in live if c.peer == peer]
                full = (
                    live
                    if len(live) >= self.max_connections
                    else same_peer
                    if len(same_peer) >= self.max_connections_per_peer
                    else None
                )
                if full is not None:
                    victim = self._victim(full)
                    if victim is None:
                        self.stats.connections_refused += 1
                        conn.close()
                        continue
                    # make room: the receiver of an idle connection finds it closed at its next
                    # pull and opens a new one (or, if its PULL was already on the way, retries)
                    victim.evicted = True
                    self.stats.connections_evicted += 1
                    _shutdown(victim.sock)
                now = time.monotonic()
                state = _Conn(conn, idle_since=now, peer=peer, opened=now)
                self._conns[conn] = state
                self.stats.connections_accepted += 1
                self._pool.submit(self._serve, state)

    @staticmethod
    def _victim(conns: list[_Conn]) -> _Conn | None:  # under lock
        """Who makes room: the oldest connection that never authenticated, else the one idle longest."""
        unauth = [c for c in conns if not c.authenticated]
        if unauth:
            return min(unauth, key=lambda c: c.opened)
        idle = [c for c in conns if c.idle_since is not None]
        return min(idle, key=lambda c: c.idle_since or 0.0) if idle else None

    def _serve(self, state: _Conn) -> None:
        conn = state.sock
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while not self._stop.is_set() and self._await_pull(state):
                conn.settimeout(self.handshake_timeout_s)  # the rest of the PULL frame: now or never
                if not self._serve_pull(conn, state):
                    break
                with self._lock:
                    state.idle_since = time.monotonic()
        except (OSError, FrameError) as exc:
            logger.debug("KV connection ended: %s", exc)
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()

    def _await_pull(self, state: _Conn) -> bool:
        """Wait for the next frame's first byte; False when the connection should end instead
        (receiver closed it, idle timeout, evicted or server closing: both shut it down)."""
        state.sock.settimeout(self.idle_timeout_s)
        try:
            if not state.sock.recv(1, socket.MSG_PEEK):
                return False
        except TimeoutError:
            logger.debug("KV connection idle for %s s: closing it", self.idle_timeout_s)
            return False
        with self._lock:
            if state.evicted:
                return False
            state.idle_since = None
        return True

    def _reply_error(self, conn: socket.socket, code: ErrorCode, text: str, request_id: str = "") -> None:
        conn.sendall(encode_frame(Frame(FrameType.ERROR, request_id=request_id, error_code=code, text=text)))

    def _serve_pull(self, conn: socket.socket, state: _Conn) -> bool:
        """Serve one PULL; True when the stream is still in sync, so the connection can carry the
        next one. An ACKed entry is unstaged before DONE is sent and freed after."""
        try:
            pull = read_frame(conn, max_nbytes=0)
        except TimeoutError:
            with self._lock:
                self.stats.handshake_timeouts += 1
            logger.debug(
                "KV connection from %s sent a partial frame for %s s: closing it", state.peer, self.handshake_timeout_s
            )
            return False
        except FrameError as exc:
            self._reply_error(conn, ErrorCode.BAD_FRAME, str(exc))
            return False
        conn.settimeout(self.io_timeout_s)
        if pull.type is not FrameType.PULL:
            self._reply_error(conn, ErrorCode.BAD_FRAME, f"expected PULL, got {pull.type.name}")
            return False
        rid = pull.request_id
        with self._lock:
            entry = self._entries.get(rid)
            if entry is None:
                past = self._history.get(rid)
                code = ErrorCode.EXPIRED if past is TransferStatus.EXPIRED else ErrorCode.UNKNOWN_ID
                text = (
                    f"request {rid!r} is not staged here"
                    if past is None
                    else f"request {rid!r} is no longer staged ({past.value})"
                )
            elif not hmac.compare_digest(pull.secret.encode(), entry.secret.encode()):
                self.stats.auth_failures += 1
                code, text, entry = ErrorCode.AUTH, "authentication failed", None
            elif entry.in_flight:
                code, text, entry = ErrorCode.BUSY, f"request {rid!r} is being pulled", None
            else:
                entry.in_flight, code, text = True, ErrorCode.NONE, ""
                state.authenticated = True
                payload = _payload(entry)
        if entry is None:
            if code is ErrorCode.AUTH:
                logger.warning("KV pull for request %s refused: wrong secret", rid)
            self._reply_error(conn, code, text, rid)
            return True
        outcome = _OUT_OF_SYNC
        try:
            outcome = self._send_payload(conn, entry, payload)
        finally:
            if outcome is not _ACKED:
                with self._lock:
                    entry.in_flight = False
                    self.stats.transfers_failed += 1
        if outcome is not _ACKED:
            return outcome is _RECEIVER_ERROR
        done = self._unstage(rid, TransferStatus.SUCCESS, only=entry)  # None if aborted meanwhile
        try:
            conn.sendall(encode_frame(Frame(FrameType.DONE, request_id=rid)))
        finally:
            if done is not None:
                self._free_later(done)
        return True

    def _send_payload(self, conn: socket.socket, entry: _Entry, payload) -> str:
        inline = entry.transport == "tcp"
        ftype = {"tcp": FrameType.DATA_INLINE, "shm": FrameType.DATA_SHM, "cuda_ipc": FrameType.DATA_CUDA_IPC}[
            entry.transport
        ]
        header = Frame(
            ftype,
            request_id=entry.request_id,
            dtype=entry.dtype,
            shape=entry.shape,
            nbytes=entry.nbytes,
            checksum=entry.checksum,
            text="" if inline else payload,
        )
        conn.sendall(encode_frame(header))
        if inline:
            view = tensor_bytes(payload)
            try:
                for off in range(0, entry.nbytes, self.chunk_bytes):
                    if self._stop.is_set():
                        return _OUT_OF_SYNC
                    conn.sendall(view[off : off + self.chunk_bytes])
            finally:
                view.release()
        reply = read_frame(conn, max_nbytes=0)
        if reply.request_id == entry.request_id:
            if reply.type is FrameType.ACK:
                return _ACKED
            if reply.type is FrameType.ERROR:
                logger.warning(
                    "KV pull of request %s failed at the receiver: %s %s",
                    entry.request_id,
                    reply.error_code.name,
                    reply.text,
                )
                return _RECEIVER_ERROR
        logger.warning(
            "KV pull of request %s: unexpected reply %s for request %r",
            entry.request_id,
            reply.type.name,
            reply.request_id,
        )
        return _OUT_OF_SYNC


def _shutdown(sock: socket.socket) -> None:
    """Wake whatever thread is blocked on `sock`; that thread closes it."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
