"""Fault hook for tests and chaos drills: extra delay before engine steps (``POST /admin/fault``).

``{"prefill_delay_ms": X, "decode_delay_ms": Y}`` sets the delays, ``{}`` clears them.
A step that will admit waiting requests (a prefill step; every step of a prefill
worker) waits ``prefill_delay_ms`` first, any other step ``decode_delay_ms``. The
wait is an ``asyncio.sleep`` on the engine loop, so HTTP handlers (health, metrics,
new requests, this endpoint) keep running meanwhile: only the engine is slowed,
which is what a slow GPU or a noisy neighbour looks like from outside.

``{"block_step_ms": Z}`` is the other kind of slowness: every engine step *blocks its thread* for Z ms
(a ``time.sleep`` inside the step), as a long CPU prefill step does. On the inline (CPU) engine loop that
thread is the event loop's, so handlers wait too: the case heartbeats must survive (they are sent
from their own thread, server/workers/heartbeat.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

MAX_DELAY_MS = 60_000.0


class FaultRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prefill_delay_ms: float = Field(default=0.0, ge=0.0, le=MAX_DELAY_MS)
    decode_delay_ms: float = Field(default=0.0, ge=0.0, le=MAX_DELAY_MS)
    block_step_ms: float = Field(default=0.0, ge=0.0, le=MAX_DELAY_MS)


@dataclass(frozen=True)
class StepDelays:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    block_s: float = 0.0  # inside the step, blocking its thread

    @classmethod
    def from_request(cls, r: FaultRequest) -> StepDelays:
        return cls(r.prefill_delay_ms / 1000.0, r.decode_delay_ms / 1000.0, r.block_step_ms / 1000.0)

    def for_step(self, has_waiting: bool) -> float:
        return self.prefill_s if has_waiting else self.decode_s

    def to_dict(self) -> dict:
        return {
            "prefill_delay_ms": self.prefill_s * 1000.0,
            "decode_delay_ms": self.decode_s * 1000.0,
            "block_step_ms": self.block_s * 1000.0,
        }
