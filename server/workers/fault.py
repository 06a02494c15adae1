"""Fault hook for tests and chaos drills: extra delay before engine steps (``POST /admin/fault``).

``{"prefill_delay_ms": X, "decode_delay_ms": Y}`` sets the delays, ``{}`` clears them;
``{"oom_forwards": N}`` makes the next N model forwards raise ``torch.cuda.OutOfMemoryError``
(:func:`arm_oom`), on CPU too, to drill what an out-of-memory step costs; ``{"oom_kv_takes": N}`` makes the
next N gathers of a prefilled prompt's KV out of the pool raise it (:func:`arm_oom_kv_takes`: what a prefill
worker whose memory is full meets after its step).
A step that will admit waiting requests (a prefill step; every step of a prefill
worker) waits ``prefill_delay_ms`` first, any other step ``decode_delay_ms``. The
wait is an ``asyncio.sleep`` on the engine loop, so HTTP handlers (health, metrics,
new requests, this endpoint) keep running meanwhile: only the engine is slowed,
which is what a slow GPU or a noisy neighbour looks like from outside.

``{"block_step_ms": Z}`` is the other kind of slowness: every engine step *blocks its thread* for Z ms
(a ``time.sleep`` inside the step), as a long CPU prefill step does. On the inline (CPU) engine loop that
thread is the event loop's, so handlers wait too: the case heartbeats must survive (they are sent
from their own thread, server/workers/heartbeat.py).

``{"stage_delay_ms": S}`` makes every staging of a prefilled prompt's KV (the copy into host memory or a
shared-memory segment, on its own thread) take S ms longer, as a big KV copied out of a busy GPU does: it
widens the moment between a prefill's step and its answer, where the KV is out of the pool and not yet staged.
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
    stage_delay_ms: float = Field(default=0.0, ge=0.0, le=MAX_DELAY_MS)
    # the next N model forwards raise torch.cuda.OutOfMemoryError (what a full device does to a step)
    oom_forwards: int = Field(default=0, ge=0, le=1_000_000)
    # the next N gathers of a prefilled prompt's KV (ModelRunner.gather_kv) raise it
    oom_kv_takes: int = Field(default=0, ge=0, le=1_000_000)


@dataclass(frozen=True)
class StepDelays:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    block_s: float = 0.0  # inside the step, blocking its thread
    stage_s: float = 0.0  # inside each KV staging, on its thread

    @classmethod
    def from_request(cls, r: FaultRequest) -> StepDelays:
        return cls(
            r.prefill_delay_ms / 1000.0, r.decode_delay_ms / 1000.0, r.block_step_ms / 1000.0, r.stage_delay_ms / 1000.0
        )

    def for_step(self, has_waiting: bool) -> float:
        return self.prefill_s if has_waiting else self.decode_s

    def to_dict(self) -> dict:
        return {
            "prefill_delay_ms": self.prefill_s * 1000.0,
            "decode_delay_ms": self.decode_s * 1000.0,
            "block_step_ms": self.block_s * 1000.0,
            "stage_delay_ms": self.stage_s * 1000.0,
        }


class OomForwards:
    """Wraps one engine's ``runner.execute`` (instance-local): the next ``remaining`` calls raise
    ``torch.cuda.OutOfMemoryError`` before running; then the real forward runs again."""

    def __init__(self, runner, attr: str = "execute") -> None:
        self.remaining = 0
        self._call = getattr(runner, attr)

    def __call__(self, *args, **kwargs):
        if self.remaining > 0:
            import torch

            self.remaining -= 1
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (fault hook)")
        return self._call(*args, **kwargs)


def arm_oom(engine, n: int, attr: str = "execute") -> OomForwards:
    hook = getattr(engine.runner, attr)
    if not isinstance(hook, OomForwards):
        hook = OomForwards(engine.runner, attr)
        setattr(engine.runner, attr, hook)
    hook.remaining = n
    return hook


def arm_oom_kv_takes(engine, n: int) -> OomForwards:
    return arm_oom(engine, n, "gather_kv")
