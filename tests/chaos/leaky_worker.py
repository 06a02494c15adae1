"""A planted defect for the slot-leak drill: a worker that keeps an aborted request's KV slot.

It reproduces the seed's §4.2 behaviour — a slot kept "for a retry" after the
client disconnects, released by nobody — by making ``abort_request`` drop the
sequence without freeing its blocks. The slot-leak drill run against this worker
must fail; against the real one it must pass. Test-only; never shipped in server/.
"""

import sys

from distserve.server.engine import llm_engine
from distserve.server.engine.sequence import SequenceStatus


def _abort_keeping_slot(self, request_id: str) -> bool:
    seq = self.requests.get(request_id)
    if seq is None:
        return False
    self.scheduler.remove(seq)
    seq.status = SequenceStatus.FINISHED_ABORTED
    self.requests.pop(request_id, None)  # forgotten, but its blocks stay allocated
    return True


llm_engine.LLMEngine.abort_request = _abort_keeping_slot

if __name__ == "__main__":
    from distserve.server.cli import main

    sys.exit(main())
