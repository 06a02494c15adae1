"""Steps that fail for lack of device memory: recognised, relieved, counted.

An out-of-memory error in an engine step must cost only the requests of that step: the engine
frees the allocator's cached blocks and retries the step's sequences one by one (those that still
fail are failed, with the error), and the worker stays up. The errors are counted (``/metrics``:
``distserve_memory_errors``) and the recent ones turn the worker's and the router's ``/health``
``degraded`` for ``WINDOW_S`` seconds after the last one.

Recognised: ``torch.cuda.OutOfMemoryError`` (torch's "CUDA out of memory"), and cuBLAS/cuDNN failing
to allocate (``CUBLAS_STATUS_ALLOC_FAILED`` when a thread creates its handle with no memory left),
which torch raises as a plain RuntimeError.
"""

from __future__ import annotations

import time
from collections import deque

import torch

WINDOW_S = 30.0
_MARKERS = ("CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED", "CUDA out of memory", "out of memory")


def is_memory_error(e: BaseException) -> bool:
    if isinstance(e, torch.cuda.OutOfMemoryError | MemoryError):
        return True
    return isinstance(e, RuntimeError) and any(m in str(e) for m in _MARKERS)


def relieve(device: torch.device) -> None:
    """Give the allocator's cached, unused blocks back so a retry can find room."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


class MemoryPressure:
    """Times of recent memory errors and the total (one per failed step, or failed retry)."""

    def __init__(self, window_s: float = WINDOW_S, keep: int = 1024) -> None:
        self.window_s = window_s
        self.total = 0
        self._times: deque[float] = deque(maxlen=keep)

    def record(self, now: float | None = None) -> None:
        self.total += 1
        self._times.append(time.monotonic() if now is None else now)

    def recent(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        while self._times and now - self._times[0] > self.window_s:
            self._times.popleft()
        return len(self._times)
