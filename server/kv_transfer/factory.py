"""Transport choice (`kv_transfer.transport` in the config) and host identity."""

from __future__ import annotations

import functools
import socket

MiB = 1 << 20
CONFIG_TRANSPORTS = ("auto", "tcp", "shm", "cuda_ipc", "nixl")


def choose_transport(configured: str, nbytes: int, same_host: bool,
                     zero_copy_threshold_mb: float) -> str:
    """'tcp' or 'shm' for one transfer.

    auto: shm when sender and receiver share a host and the payload is at least the threshold
    (below it, a TCP round trip on loopback costs less than creating and mapping a segment);
    tcp otherwise.
    """
    if configured == "auto":
        use_shm = same_host and nbytes >= zero_copy_threshold_mb * MiB
        return "shm" if use_shm else "tcp"
    if configured == "tcp":
        return "tcp"
    if configured == "shm":
        if not same_host:
            raise ValueError("kv_transfer.transport=shm needs the prefill and decode workers on "
                             "the same host; use 'tcp' or 'auto' for workers on different hosts")
        return "shm"
    if configured in ("cuda_ipc", "nixl"):
        raise NotImplementedError(f"kv_transfer.transport={configured!r} is not implemented yet; "
                                  "use 'auto', 'tcp' or 'shm'")
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
