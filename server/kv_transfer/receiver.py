"""Decode-side puller: one TCP connection per pull, payload inline, through shared memory, or
GPU to GPU through a CUDA IPC handle (cuda_ipc.py; the tensor then lands on `cuda_device`).

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
from .frame import (DEFAULT_MAX_NBYTES, ErrorCode, Frame, FrameType, encode_frame,
                    read_frame, tensor_bytes)
from .shm import AttachedSegment

logger = logging.getLogger(__name__)

_EOF_WAIT_S = 2.0


class _PullFailed(Exception):
    def __init__(self, message: str, status: TransferStatus = TransferStatus.FAILED):
        super().__init__(message)
        self.status = status


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
        raise _PullFailed(f"out is {out.dtype}{tuple(out.shape)}, handle is "
                          f"{handle.dtype}{handle.shape}")


class KVPuller(KVReceiver):
    """KVReceiver for handles staged by KVStagingServer (transports tcp, shm and cuda_ipc)."""

    def __init__(self, *, max_nbytes: int = DEFAULT_MAX_NBYTES, chunk_bytes: int = 8 << 20,
                 verify_checksum: bool = True, cuda_device: torch.device | str | None = None):
        self.max_nbytes = max_nbytes
        self.chunk_bytes = chunk_bytes
        self.verify_checksum = verify_checksum
        self.cuda_device = cuda_device  # where cuda_ipc payloads land; None: cuda_ipc pulls fail
        self._importer = None
        self._local = threading.local()

    @property
    def last_timings(self) -> dict | None:
        """Phases of this thread's last successful cuda_ipc pull, in seconds (diagnostics)."""
        return getattr(self._local, "timings", None)

    def pull(self, handle: KVHandle, timeout_s: float = 30.0, *,
             out: torch.Tensor | None = None) -> PullResult:
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
            return PullResult(TransferStatus.SUCCESS, tensor, None, handle.nbytes,
                              time.perf_counter() - start)
        logger.warning("KV pull for request %s: %s (%s)", rid, status.value, error)
        return PullResult(status, None, error, 0, time.perf_counter() - start)

    def _pull(self, handle: KVHandle, deadline: _Deadline,
              out: torch.Tensor | None) -> torch.Tensor:
        if not isinstance(handle, KVHandle):
            raise _PullFailed(f"expected a KVHandle, got {type(handle).__name__}")
        handle.validate(self.max_nbytes)
        if out is not None:
            _check_out(handle, out)
        host, port = parse_address(handle.address)
        t0 = time.perf_counter()
        with socket.create_connection((host, port), timeout=deadline.remaining()) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            t1 = time.perf_counter()
            sock.sendall(encode_frame(Frame(FrameType.PULL, request_id=handle.request_id,
                                            secret=handle.secret)))
            sock.settimeout(deadline.remaining())
            header = read_frame(sock, self.max_nbytes)
            checksum = self._check_header(handle, header)
            if header.type is FrameType.DATA_CUDA_IPC:
                t2 = time.perf_counter()
                tensor = self._copy_ipc(sock, handle, header, out)
                t3 = time.perf_counter()
                sock.sendall(encode_frame(Frame(FrameType.ACK, request_id=handle.request_id)))
                self._wait_for_close(sock, deadline)
                # diagnostics (bench/kv_transfer_gpu.py): where the time of the last pull went
                self._local.timings = {"connect_s": t1 - t0, "pull_to_header_s": t2 - t1,
                                       "open_copy_sync_s": t3 - t2,
                                       "ack_to_close_s": time.perf_counter() - t3}
                return tensor
            tensor = torch.empty(handle.shape, dtype=handle.torch_dtype) if out is None else out
            dst = tensor_bytes(tensor)
            try:
                if header.type is FrameType.DATA_INLINE:
                    self._recv_payload(sock, dst, deadline)
                else:
                    self._copy_from_segment(header.text, dst)
                if checksum is not None and zlib.crc32(dst) != checksum:
                    sock.sendall(encode_frame(Frame(FrameType.ERROR, request_id=handle.request_id,
                                                    error_code=ErrorCode.CHECKSUM,
                                                    text="payload crc32 mismatch")))
                    raise _PullFailed("checksum mismatch: payload corrupted in transfer")
            finally:
                dst.release()
            sock.sendall(encode_frame(Frame(FrameType.ACK, request_id=handle.request_id)))
            self._wait_for_close(sock, deadline)
        return tensor

    def _check_header(self, handle: KVHandle, header: Frame) -> int | None:
        """Header must describe exactly what the handle promised; returns the crc to verify."""
        if header.type is FrameType.ERROR:
            status = (TransferStatus.EXPIRED if header.error_code is ErrorCode.EXPIRED
                      else TransferStatus.FAILED)
            raise _PullFailed(f"sender refused ({header.error_code.name}): {header.text}", status)
        want = {"tcp": FrameType.DATA_INLINE, "shm": FrameType.DATA_SHM,
                "cuda_ipc": FrameType.DATA_CUDA_IPC}[handle.transport]
        if header.type is not want:
            raise _PullFailed(f"expected {want.name} for transport {handle.transport}, "
                              f"got {header.type.name}")
        mismatch = [f"{name} {got} != {exp}" for name, got, exp in (
            ("request id", header.request_id, handle.request_id),
            ("dtype", header.dtype, handle.torch_dtype),
            ("shape", header.shape, handle.shape),
            ("nbytes", header.nbytes, handle.nbytes),
        ) if got != exp]
        if handle.checksum is not None and header.checksum != handle.checksum:
            mismatch.append(f"checksum {header.checksum} != {handle.checksum}")
        if mismatch:
            raise _PullFailed("reply does not match the handle: " + "; ".join(mismatch))
        return header.checksum if self.verify_checksum else None

    def _copy_ipc(self, sock: socket.socket, handle: KVHandle, header: Frame,
                  out: torch.Tensor | None) -> torch.Tensor:
        """Open, copy GPU to GPU, close; on failure tell the sender (it keeps the entry)."""
        from . import cuda_ipc

        try:
            desc = cuda_ipc.parse_description(header.text, handle.nbytes)
            if self._importer is None:
                self._importer = cuda_ipc.IpcImporter(self.cuda_device)
            return self._importer.copy(desc, handle.torch_dtype, handle.shape, out)
        except cuda_ipc.IpcError as exc:
            try:
                sock.sendall(encode_frame(Frame(FrameType.ERROR, request_id=handle.request_id,
                                                error_code=ErrorCode.GENERIC,
                                                text=str(exc)[:500])))
            except OSError:
                pass
            raise _PullFailed(f"cuda_ipc: {exc}") from None

    def close(self) -> None:
        if self._importer is not None:
            self._importer.close()

    def _recv_payload(self, sock: socket.socket, dst: memoryview, deadline: _Deadline) -> None:
        got, total = 0, len(dst)
        while got < total:
            sock.settimeout(deadline.remaining())
            n = sock.recv_into(dst[got:got + self.chunk_bytes])
            if n == 0:
                raise _PullFailed(f"sender closed the connection after {got} of {total} "
                                  "payload bytes")
            got += n

    @staticmethod
    def _copy_from_segment(name: str, dst: memoryview) -> None:
        with AttachedSegment(name, len(dst)) as seg:
            src = seg.buf[:len(dst)]
            try:
                dst[:] = src
            finally:
                src.release()

    @staticmethod
    def _wait_for_close(sock: socket.socket, deadline: _Deadline) -> None:
        """The sender frees the entry, then closes: waiting for EOF makes a successful pull()
        return only after the staging slot is free (no race for callers that check it)."""
        try:
            sock.settimeout(min(_EOF_WAIT_S, deadline.remaining()))
            sock.recv(1)
        except OSError:
            pass
