"""KV-cache data plane between prefill (sender) and decode (receiver) workers.

See docs/ARCHITECTURE.md and DESIGN section 5. Public surface:

- `KVSender` / `KVReceiver`: the two-sided seam; `KVStagingServer` / `KVPuller` implement it over
  persistent TCP control connections with the payload inline (`tcp`) or in POSIX shared memory (`shm`).
- `KVHandle`: what travels through the router (JSON via to_dict/from_dict; it is a capability).
- `PullResult` / `TransferStatus`: failures are data.
- `choose_transport`, `host_id`: the `auto` policy and locality.
- `frame`: the binary wire format (`FrameError` for anything malformed). Nothing is pickled.
"""

from .base import KVHandle, KVReceiver, KVSender, PullResult, TransferStatus
from .factory import choose_transport, host_id
from .frame import DEFAULT_MAX_NBYTES, FrameError
from .receiver import KVPuller
from .sender import KVStagingServer, SenderStats, StagingFullError

__all__ = [
    "DEFAULT_MAX_NBYTES",
    "FrameError",
    "KVHandle",
    "KVPuller",
    "KVReceiver",
    "KVSender",
    "KVStagingServer",
    "PullResult",
    "SenderStats",
    "StagingFullError",
    "TransferStatus",
    "choose_transport",
    "host_id",
]
