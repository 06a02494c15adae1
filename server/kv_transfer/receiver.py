"""Decode-side puller: payload inline, through shared memory, or GPU to GPU through a CUDA IPC
handle (cuda_ipc.py; the tensor then lands on `cuda_device`), over persistent control connections.

Connections are pooled per sender address (`_ConnPool`; protocol in frame.py): a pull takes an idle
connection (or opens one), has it to itself, and gives it back once the sender has answered its ACK
with DONE — the entry is unstaged by then, so a successful pull() returns with the staging slot
free. A connection that saw a failure, a timeout or anything unexpected is closed, never reused;
only a clean refusal by the sender (ERROR UNKNOWN_ID, EXPIRED, AUTH or BUSY for our request id)
leaves it in sync and pooled. A pooled connection may be dead when it is next used (sender
restarted, its idle timeout, evicted at its connection cap): one that reads as closed is dropped
before use, and one that fails before a single byte of the reply arrived — nothing of the payload
received — is retried once on a fresh connection.

The reply header must match the handle exactly (dtype, shape, nbytes, checksum) before anything is
allocated, so a confused or hostile sender can neither make us allocate more than the handle —
already capped when it was parsed — promised, nor hand us a tensor of the wrong shape. Every failure
comes back as a PullResult (FAILED, or EXPIRED when the sender says the lease ended); `pull` raises
nothing, so the decode scheduler can apply its failure policy without guarding I/O.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import zlib

import torch

from .base import KVHandle, KVReceiver, PullResult, TransferStatus, parse_address
from .frame import DEFAULT_MAX_NBYTES, ErrorCode, Frame, FrameType, encode_frame, read_frame, tensor_bytes
from .shm import AttachedSegment

logger = logging.getLogger(__name__)

_DONE_WAIT_S = 2.0
_EXPIRE_EVERY_S = 1.0
# refusals after which the sender keeps reading PULLs on the connection
_IN_SYNC_REFUSALS = (ErrorCode.UNKNOWN_ID, ErrorCode.EXPIRED, ErrorCode.AUTH, ErrorCode.BUSY)

Address = tuple[str, int]


class _PullFailed(Exception):
    def __init__(self, message: str, status: TransferStatus = TransferStatus.FAILED, *, in_sync: bool = False):
        super().__init__(message)
        self.status = status
        self.in_sync = in_sync  # the connection may carry the next pull


class _StaleConnection(Exception):
    """A reused connection failed before any byte of the reply: safe to retry on a fresh one."""


class _Deadline:
    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.end = time.monotonic() + timeout_s

    def remaining(self) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"timed out after {self.timeout_s:g} s")
        return left


def _check_out(handle: KVHandle, out: torch.Tensor) -> None:
    want = "cuda" if handle.transport == "cuda_ipc" else "cpu"
    if not isinstance(out, torch.Tensor) or out.device.type != want or not out.is_contiguous():
        raise _PullFailed(f"out must be a contiguous {want.upper()} tensor")
    if tuple(out.shape) != handle.shape or out.dtype != handle.torch_dtype:
        raise _PullFailed(f"out is {out.dtype}{tuple(out.shape)}, handle is {handle.dtype}{handle.shape}")


def _looks_open(sock: socket.socket) -> bool:
    """Nothing to read on an idle connection: no EOF (the sender closed it: idle timeout, restart,
    eviction), no reset, and no stray byte (out of sync)."""
    try:
        sock.settimeout(0.0)
        sock.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False


class _ConnPool:
    """Idle control connections by sender address, thread-safe. A connection is either in here or
    in the hands of exactly one pull."""

    def __init__(self, max_idle_per_address: int, max_idle_s: float):
        self.max_idle_per_address = max_idle_per_address
        self.max_idle_s = max_idle_s
        self._lock = threading.Lock()
        self._idle: dict[Address, list[tuple[socket.socket, float]]] = {}  # oldest first
        self._closed = False
        self._next_expiry = 0.0

    def take(self, key: Address) -> socket.socket | None:
        """The most recently used idle connection to `key` that still looks open, or None."""
        while True:
            with self._lock:
                conns = self._idle.get(key)
                if not conns:
                    return None
                sock, since = conns.pop()
                if not conns:
                    del self._idle[key]
            if time.monotonic() - since < self.max_idle_s and _looks_open(sock):
                return sock
            sock.close()

    def give(self, key: Address, sock: socket.socket) -> None:
        now = time.monotonic()
        with self._lock:
            closing = self._expire(now) if now >= self._next_expiry else []
            conns = self._idle.get(key, [])
            if self._closed or len(conns) >= self.max_idle_per_address:
                closing.append(sock)
            else:
                conns.append((sock, now))
                self._idle[key] = conns
        for s in closing:
            s.close()

    def _expire(self, now: float) -> list[socket.socket]:  # under lock
        """Take out connections idle too long (senders that went away leave theirs behind)."""
        self._next_expiry = now + _EXPIRE_EVERY_S
        out = []
        for key in list(self._idle):
            conns = self._idle[key]
            keep = [(s, t) for s, t in conns if now - t < self.max_idle_s]
            out += [s for s, t in conns if now - t >= self.max_idle_s]
            if keep:
                self._idle[key] = keep
            else:
                del self._idle[key]
        return out

    def drop(self, key: Address) -> None:
        """Close every idle connection to `key` (one of them was found dead: so are the others,
        most likely)."""
        with self._lock:
            conns = self._idle.pop(key, [])
        for s, _ in conns:
            s.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns, self._idle = [s for c in self._idle.values() for s, _ in c], {}
        for s in conns:
            s.close()

    def __len__(self) -> int:
        with self._lock:
            return sum(len(c) for c in self._idle.values())


class KVPuller(KVReceiver):
    """KVReceiver for handles staged by KVStagingServer (transports tcp, shm and cuda_ipc).

    `max_idle_per_address`: connections kept open per sender between pulls (0: close each after
    its pull, one connection per pull); `idle_timeout_s`: a kept connection unused this long is
    closed rather than reused (below the sender's own idle timeout, 60 s by default). Thread-safe:
    concurrent pulls each use a connection of their own."""

    def __init__(
        self,
        *,
        max_nbytes: int = DEFAULT_MAX_NBYTES,
        chunk_bytes: int = 8 << 20,
        verify_checksum: bool = True,
        cuda_device: torch.device | str | None = None,
        max_idle_per_address: int = 8,
        idle_timeout_s: float = 50.0,
    ):
        self.max_nbytes = max_nbytes
        self.chunk_bytes = chunk_bytes
        self.verify_checksum = verify_checksum
        self.cuda_device = cuda_device  # where cuda_ipc payloads land; None: cuda_ipc pulls fail
        self._importer = None
        self._local = threading.local()
        self._conns = _ConnPool(max_idle_per_address, idle_timeout_s)

    @property
    def last_timings(self) -> dict | None:
        """Where this thread's last successful pull spent its time (diagnostics,
        bench/kv_transfer/kv_transfer_gpu.py): `reused` (a pooled connection), `retried` (a pooled one was
        dead: this is the second attempt), and in seconds `connect_s` (getting the connection:
        the pool lookup alone when reused), `pull_to_header_s` (PULL sent -> reply header checked),
        `copy_s` (payload received / copied out of shm / IPC open+copy+sync, crc32 included) and
        `ack_to_done_s` (ACK sent -> the sender's DONE: entry unstaged)."""
        return getattr(self._local, "timings", None)

    @property
    def num_idle_connections(self) -> int:
        return len(self._conns)

    def pull(self, handle: KVHandle, timeout_s: float = 30.0, *, out: torch.Tensor | None = None) -> PullResult:
        """Pull into a fresh tensor, or into `out` (contiguous CPU, same shape and dtype) when the
        caller has memory ready: a fresh multi-MiB tensor costs a page fault per 4 KiB on first
        touch, which on a VM can cost more than the copy itself. `out` may be partly written when
        the pull fails."""
        start = time.perf_counter()
        rid = getattr(handle, "request_id", "?")
        try:
            tensor = self._pull(handle, _Deadline(timeout_s), out)
        except _PullFailed as exc:
            status, error = exc.status, str(exc)
        except TimeoutError:
            status, error = TransferStatus.FAILED, f"timed out after {timeout_s:g} s"
        except ConnectionRefusedError:
            status, error = TransferStatus.FAILED, f"connection refused by {handle.address}"
        except (OSError, ValueError, MemoryError) as exc:  # FrameError is a ValueError
            status, error = TransferStatus.FAILED, f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # a bug must still not escape into the decode loop
            logger.exception("unexpected error pulling KV for request %s", rid)
            status, error = TransferStatus.FAILED, f"internal error: {exc!r}"
        else:
            return PullResult(TransferStatus.SUCCESS, tensor, None, handle.nbytes, time.perf_counter() - start)
        logger.warning("KV pull for request %s: %s (%s)", rid, status.value, error)
        return PullResult(status, None, error, 0, time.perf_counter() - start)

    def _pull(self, handle: KVHandle, deadline: _Deadline, out: torch.Tensor | None) -> torch.Tensor:
        if not isinstance(handle, KVHandle):
            raise _PullFailed(f"expected a KVHandle, got {type(handle).__name__}")
        handle.validate(self.max_nbytes)
        if out is not None:
            _check_out(handle, out)
        key = parse_address(handle.address)
        retried = False
        while True:
            t0 = time.perf_counter()
            sock = None if retried else self._conns.take(key)
            reused = sock is not None
            if sock is None:
                sock = socket.create_connection(key, timeout=deadline.remaining())
            t1 = time.perf_counter()
            in_sync = False
            try:
                if not reused:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                tensor, in_sync, phases = self._exchange(sock, handle, deadline, out, reused)
            except _StaleConnection as exc:
                logger.debug("pooled KV connection to %s was dead (%s): retrying on a new one", handle.address, exc)
                self._conns.drop(key)
                retried = True
                continue
            except _PullFailed as exc:
                in_sync = exc.in_sync
                raise
            finally:
                if in_sync:
                    self._conns.give(key, sock)
                else:
                    sock.close()
            self._local.timings = {"reused": reused, "retried": retried, "connect_s": t1 - t0, **phases}
            return tensor

    def _exchange(
        self, sock: socket.socket, handle: KVHandle, deadline: _Deadline, out: torch.Tensor | None, reused: bool
    ) -> tuple[torch.Tensor, bool, dict]:
        """One pull on `sock`: (tensor, whether the connection is in sync for the next, phases)."""
        rid = handle.request_id
        t1 = time.perf_counter()
        # cuda_ipc from a staging pool: the copy starts right after the PULL is sent, before its
        # reply (queuing it costs ~0.5 ms of host time on the H200 host, about one round trip); the
        # reply then confirms that the entry is still staged (and pins it until our ACK). Sound
        # because a staged entry's bytes never change, and a pool region is reused only after its
        # entry is gone — in which case the reply is an ERROR and the copy is thrown away.
        early = None
        t_early = t1
        try:
            try:
                sock.settimeout(deadline.remaining())
                sock.sendall(encode_frame(Frame(FrameType.PULL, request_id=rid, secret=handle.secret)))
                if handle.ipc:
                    early = self._start_early_copy(handle, out)
                    t_early = time.perf_counter()
                first = sock.recv(1, socket.MSG_PEEK)  # nothing consumed: read_frame reads it again
            except ConnectionError as exc:  # reset, broken pipe: not a byte of the reply yet
                if reused:
                    raise _StaleConnection(str(exc)) from None
                raise
            if not first:
                if reused:
                    raise _StaleConnection("closed by the sender")
                raise _PullFailed("sender closed the connection before replying (at its connection limit?)")
            header = read_frame(sock, self.max_nbytes)
            checksum = self._check_header(handle, header)
        except BaseException:
            if early is not None:
                early.discard()  # never leave a queued copy into `out` behind
            raise
        t2 = time.perf_counter()
        if header.type is FrameType.DATA_CUDA_IPC:
            tensor = self._copy_ipc(sock, handle, header, out, early)
        else:
            tensor = torch.empty(handle.shape, dtype=handle.torch_dtype) if out is None else out
            dst = tensor_bytes(tensor)
            try:
                if header.type is FrameType.DATA_INLINE:
                    self._recv_payload(sock, dst, deadline)
                else:
                    self._copy_from_segment(header.text, dst)
                if checksum is not None and zlib.crc32(dst) != checksum:
                    sock.sendall(
                        encode_frame(
                            Frame(
                                FrameType.ERROR,
                                request_id=rid,
                                error_code=ErrorCode.CHECKSUM,
                                text="payload crc32 mismatch",
                            )
                        )
                    )
                    raise _PullFailed("checksum mismatch: payload corrupted in transfer")
            finally:
                dst.release()
        t3 = time.perf_counter()
        sock.sendall(encode_frame(Frame(FrameType.ACK, request_id=rid)))
        in_sync = self._wait_for_done(sock, rid, deadline)
        phases = {
            "start_copy_s": t_early - t1,
            "pull_to_header_s": t2 - t1,
            "copy_s": t3 - t2,
            "ack_to_done_s": time.perf_counter() - t3,
        }
        return tensor, in_sync, phases

    def _check_header(self, handle: KVHandle, header: Frame) -> int | None:
        """Header must describe exactly what the handle promised; returns the crc to verify."""
        if header.type is FrameType.ERROR:
            status = TransferStatus.EXPIRED if header.error_code is ErrorCode.EXPIRED else TransferStatus.FAILED
            in_sync = header.error_code in _IN_SYNC_REFUSALS and header.request_id == handle.request_id
            raise _PullFailed(f"sender refused ({header.error_code.name}): {header.text}", status, in_sync=in_sync)
        want = {"tcp": FrameType.DATA_INLINE, "shm": FrameType.DATA_SHM, "cuda_ipc": FrameType.DATA_CUDA_IPC}[
            handle.transport
        ]
        if header.type is not want:
            raise _PullFailed(f"expected {want.name} for transport {handle.transport}, got {header.type.name}")
        mismatch = [
            f"{name} {got} != {exp}"
            for name, got, exp in (
                ("request id", header.request_id, handle.request_id),
                ("dtype", header.dtype, handle.torch_dtype),
                ("shape", header.shape, handle.shape),
                ("nbytes", header.nbytes, handle.nbytes),
            )
            if got != exp
        ]
        if handle.checksum is not None and header.checksum != handle.checksum:
            mismatch.append(f"checksum {header.checksum} != {handle.checksum}")
        if mismatch:
            raise _PullFailed("reply does not match the handle: " + "; ".join(mismatch))
        return header.checksum if self.verify_checksum else None

    def _copy_ipc(
        self, sock: socket.socket, handle: KVHandle, header: Frame, out: torch.Tensor | None, early
    ) -> torch.Tensor:
        """Finish the early copy when the reply names the same bytes as the handle; else open,
        copy GPU to GPU, close. On failure tell the sender (it keeps the entry)."""
        from . import cuda_ipc

        try:
            if early is not None and header.text == handle.ipc:
                return early.wait()
            if early is not None:
                early.discard()
            desc = cuda_ipc.parse_description(header.text, handle.nbytes)
            return self._importer_for_ipc().copy(desc, handle.torch_dtype, handle.shape, out)
        except cuda_ipc.IpcError as exc:
            try:
                sock.sendall(
                    encode_frame(
                        Frame(
                            FrameType.ERROR,
                            request_id=handle.request_id,
                            error_code=ErrorCode.GENERIC,
                            text=str(exc)[:500],
                        )
                    )
                )
            except OSError:
                pass
            raise _PullFailed(f"cuda_ipc: {exc}") from None

    def _importer_for_ipc(self):
        from . import cuda_ipc

        if self._importer is None:
            self._importer = cuda_ipc.IpcImporter(self.cuda_device)
        return self._importer

    def _start_early_copy(self, handle: KVHandle, out: torch.Tensor | None):
        """Start the copy described in the handle (pool entries only); None: the normal path."""
        from . import cuda_ipc

        if handle.transport != "cuda_ipc" or self.cuda_device is None:
            return None
        try:
            desc = cuda_ipc.parse_description(handle.ipc, handle.nbytes)
            if not desc.pool:
                return None  # an own export may be freed under us: open it only after the reply
            return self._importer_for_ipc().start_copy(desc, handle.torch_dtype, handle.shape, out)
        except cuda_ipc.IpcError as exc:
            logger.debug("early cuda_ipc copy for %s not started: %s", handle.request_id, exc)
            return None

    def close(self) -> None:
        """Close pooled connections (and IPC mappings). Later pulls still work, on a connection
        each that is closed after its pull."""
        self._conns.close()
        if self._importer is not None:
            self._importer.close()

    def _recv_payload(self, sock: socket.socket, dst: memoryview, deadline: _Deadline) -> None:
        got, total = 0, len(dst)
        while got < total:
            sock.settimeout(deadline.remaining())
            n = sock.recv_into(dst[got : got + self.chunk_bytes])
            if n == 0:
                raise _PullFailed(f"sender closed the connection after {got} of {total} payload bytes")
            got += n

    @staticmethod
    def _copy_from_segment(name: str, dst: memoryview) -> None:
        with AttachedSegment(name, len(dst)) as seg:
            if seg.buf is None:
                raise ConnectionError(f"shm segment {name} has no buffer")
            src = seg.buf[: len(dst)]
            try:
                dst[:] = src
            finally:
                src.release()

    @staticmethod
    def _wait_for_done(sock: socket.socket, request_id: str, deadline: _Deadline) -> bool:
        """The sender unstages the entry, then answers DONE: waiting for it makes a successful
        pull() return only after the staging slot is free (no race for callers that check it).
        True when DONE came and the connection can carry the next pull. The payload is verified
        by now, so whatever else happens the pull stays successful, but the connection is not
        reused: a close (an older sender closes instead of answering), a timeout, another frame."""
        try:
            sock.settimeout(min(_DONE_WAIT_S, deadline.remaining()))
            done = read_frame(sock, max_nbytes=0)
        except (OSError, ValueError):  # TimeoutError is an OSError, FrameError a ValueError
            return False
        if done.type is FrameType.DONE and done.request_id == request_id:
            return True
        logger.warning(
            "KV pull for request %s: expected DONE, got %s for %r; closing the connection",
            request_id,
            done.type.name,
            done.request_id,
        )
        return False
