"""Transport choice (`kv_transfer.transport` in the config) and host identity."""

from __future__ import annotations

import functools
import socket

MiB = 1 << 20
CONFIG_TRANSPORTS = ("auto", "tcp", "shm", "cuda_ipc", "nixl")


def choose_transport(
    configured: str,
    nbytes: int,
    same_host: bool,
    zero_copy_threshold_mb: float,
    *,
    kv_on_cuda: bool = False,
    peer_gpu: bool | None = None,
) -> str:
    """'tcp', 'shm' or 'cuda_ipc' for one transfer.

    `kv_on_cuda`: the staged KV is on a GPU of the sender. `peer_gpu`: the receiver runs on CUDA
    and can see that GPU (None: not known).

    auto: cuda_ipc when the KV is on a GPU and the receiver is on the same host and can open it
    (GPU to GPU, no host copy); else shm when both share a host and the payload is at least the
    threshold (below it, a TCP round trip on loopback costs less than creating and mapping a
    segment); tcp otherwise.
    """
    if configured == "auto":
        if kv_on_cuda and same_host and peer_gpu:
            return "cuda_ipc"
        use_shm = same_host and nbytes >= zero_copy_threshold_mb * MiB
        return "shm" if use_shm else "tcp"
    if configured == "tcp":
        return "tcp"
    if configured == "shm":
        if not same_host:
            raise ValueError(
                "kv_transfer.transport=shm needs the prefill and decode workers on "
                "the same host; use 'tcp' or 'auto' for workers on different hosts"
            )
        return "shm"
    if configured == "cuda_ipc":
        if not kv_on_cuda:
            raise ValueError(
                "kv_transfer.transport=cuda_ipc needs prefill workers on CUDA "
                "(--device cuda); use 'auto', 'tcp' or 'shm' on CPU"
            )
        if not same_host or peer_gpu is False:
            raise ValueError(
                "kv_transfer.transport=cuda_ipc needs a decode worker on CUDA on the "
                "same host that can see the prefill worker's GPU; use 'auto'"
            )
        return "cuda_ipc"
    if configured == "nixl":
        raise NotImplementedError(
            f"kv_transfer.transport={configured!r} is not implemented yet; use 'auto', 'tcp', 'shm' or 'cuda_ipc'"
        )
    raise ValueError(f"kv_transfer.transport={configured!r}; expected one of {CONFIG_TRANSPORTS}")


@functools.lru_cache(maxsize=1)
def host_id() -> str:
    """Hostname plus the kernel boot id, so two machines (or VMs) that share a hostname are not
    taken for one host. Containers on one kernel share the boot id but maybe not /dev/shm: there
    a shm pull fails cleanly (FAILED) and `auto` should be configured as `tcp`."""
    name = socket.gethostname()
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f"{name}/{f.read().strip()}"
    except OSError:
        return name
