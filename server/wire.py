"""Router ↔ worker messages (JSON over HTTP; token streams as NDJSON lines).

A neutral module: the router and the workers both build *and* parse these models (the router
validates every prefill answer and every stream line it reads with them), so a field renamed on
one side breaks the other's tests rather than production. The worker writes the per-token
``StreamLine`` with a preformatted fast path that ``tests/unit/test_hot_paths.py`` pins to
``StreamLine``'s JSON byte for byte.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, StringConstraints, model_validator

CREDENTIAL_HEADER = "x-worker-credential"  # a worker's own credential, issued at registration (router/identity.py)

Role = Literal["prefill", "decode", "colocated"]  # a worker's job; the router routes by it
ROLES: tuple[Role, ...] = ("prefill", "decode", "colocated")


class StructuredConstraint(BaseModel):
    """The output's grammar (``server/engine/structured/grammar.py``'s ``Constraint``)."""

    kind: Literal["json", "regex", "choice", "grammar"]
    text: str = Field(max_length=4 << 20)
    strict: bool = False


class InternalSampling(BaseModel):
    max_tokens: int = Field(ge=1)
    temperature: float = Field(ge=0.0, le=100.0)
    top_p: float = Field(gt=0.0, le=1.0)
    top_k: int = Field(ge=0, default=0)
    seed: int | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    min_p: float = Field(ge=0.0, le=1.0, default=0.0)
    presence_penalty: float = Field(ge=-2.0, le=2.0, default=0.0)
    frequency_penalty: float = Field(ge=-2.0, le=2.0, default=0.0)
    repetition_penalty: float = Field(gt=0.0, le=10.0, default=1.0)
    logit_bias: list[tuple[int, float]] = Field(default_factory=list, max_length=300)
    logprobs: int | None = Field(ge=0, le=20, default=None)  # None: no logprobs; k: sampled + k most likely
    structured: StructuredConstraint | None = None


class TokenLogprob(BaseModel):
    """One generated token's logprob (of the raw logits) and the k most likely ``[id, logprob]``."""

    logprob: float
    top: list[tuple[int, float]] = Field(default_factory=list, max_length=20)


class _WithLogprobs(BaseModel):
    """A message of token ids that may carry one ``TokenLogprob`` per id."""

    token_ids: list[int] = Field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # one per token id when the request asked for logprobs

    @model_validator(mode="after")
    def _one_per_token(self):
        if self.logprobs is not None and len(self.logprobs) != len(self.token_ids):
            raise ValueError(f"{len(self.logprobs)} logprobs for {len(self.token_ids)} token ids")
        return self


class PrefillRequest(BaseModel):
    request_id: str = Field(min_length=1, max_length=256)
    prompt_token_ids: list[int] = Field(min_length=1)
    output_token_ids: list[int] = Field(default_factory=list)  # tokens generated before a migration
    sampling: InternalSampling
    peer_host_id: str | None = None  # host of the decode worker that will pull
    # GPUs the decode worker can open CUDA IPC handles of (None: unknown, e.g. an older router)
    peer_cuda_uuids: list[str] | None = Field(default=None, max_length=64)
    # the decode worker's KV lessor (host:port) when its pool takes KV by reference (kv_reference.py)
    peer_kv_arena: str | None = Field(default=None, max_length=300)


class PrefillResponse(_WithLogprobs):
    finished: bool
    finish_reason: str | None = None
    error: str | None = None  # why the engine aborted it (finish_reason "abort")
    kv: dict[str, Any] | None = None  # KVHandle.to_dict() when not finished
    prefill_seconds: float = 0.0
    num_cached_tokens: int | None = Field(default=None, ge=0)  # prompt tokens the prefix cache served


class GenerateRequest(BaseModel):
    """Decode (with ``kv``) or colocated/recompute (``kv`` null) generation."""

    request_id: str = Field(min_length=1, max_length=256)
    prompt_token_ids: list[int] = Field(min_length=1)
    output_token_ids: list[int] = Field(default_factory=list)
    sampling: InternalSampling
    kv: dict[str, Any] | None = None


class StreamLine(_WithLogprobs):
    """One NDJSON line of a generate stream."""

    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    kv_transfer_seconds: float | None = None
    kv_transfer_bytes: int | None = None
    kv_transport: str | None = None
    num_cached_tokens: int | None = Field(default=None, ge=0)  # first line: prompt tokens the prefix cache served


class AbortRequest(BaseModel):
    request_id: str


class DeregisterRequest(BaseModel):
    """A worker leaving (no reason: forget it), or the launcher reporting its exit (reason: list it dead)."""

    worker_id: str = Field(min_length=1, max_length=128)
    reason: str | None = Field(default=None, max_length=256)
    pid: int | None = None  # a worker's own goodbye: forget the entry only while it is still this process's


class DrainRequest(BaseModel):
    """Take a worker out of rotation before it leaves (scale-down); its requests in flight continue."""

    worker_id: str = Field(min_length=1, max_length=128)


MAX_LOAD_FIGURE = 2**31 - 1  # a load figure above this is a bug or an attack, never a real count


MAX_PREFIX_BLOCKS = 4096  # digests one prefix summary may carry (a heartbeat stays well under 200 KB)
PrefixDigest = Annotated[str, StringConstraints(min_length=32, max_length=32, pattern=r"^[0-9a-f]{32}$")]


class WorkerStatus(BaseModel):
    """A worker's load, as it heartbeats it: counts, each in [0, MAX_LOAD_FIGURE] (else 400 naming it).

    Prefix summary (cache-aware routing, ``server/router/prefix_index.py``): ``prefix_blocks`` lists the hex
    digests (``server/prefix_hash.py``) of the full blocks its prefix cache holds, at most
    ``MAX_PREFIX_BLOCKS``, as of ``prefix_version``. It *replaces* what the router knew of this worker;
    ``None`` means "unchanged since the summary of this version" (the router keeps its copy only when the
    versions match, else drops it). ``prefix_block_size`` 0: no prefix caching, no summary."""

    num_waiting: int = Field(default=0, ge=0, le=MAX_LOAD_FIGURE, strict=True)
    num_running: int = Field(default=0, ge=0, le=MAX_LOAD_FIGURE, strict=True)
    num_reserving: int = Field(default=0, ge=0, le=MAX_LOAD_FIGURE, strict=True)
    # of those, the ones waiting because the KV pool refused the first in line for lack of blocks (decode room:
    # a reservation merely deferred until the running engine step ends is not short of room)
    num_kv_blocked: int = Field(default=0, ge=0, le=MAX_LOAD_FIGURE, strict=True)
    kv_blocks_used: int = Field(default=0, ge=0, le=MAX_LOAD_FIGURE, strict=True)
    kv_blocks_free: int = Field(default=0, ge=0, le=MAX_LOAD_FIGURE, strict=True)
    num_staged_kv: int = Field(default=0, ge=0, le=MAX_LOAD_FIGURE, strict=True)
    # engine steps that failed for lack of device memory in the last MEMORY_PRESSURE_WINDOW_S (health: degraded)
    memory_errors_recent: int = Field(default=0, ge=0, le=MAX_LOAD_FIGURE, strict=True)
    # an engine step is running right now (the router lets a quiet stream or prefill wait through a long
    # step of a worker that still heartbeats; a worker stalled between steps fails at the progress deadline)
    in_step: bool = Field(default=False, strict=True)
    # engine steps completed so far (a counter): a worker whose count moves is working through its queue even
    # when each heartbeat happens to fall between two steps; one whose count stands still is not
    num_steps: int = Field(default=0, ge=0, le=2**62, strict=True)
    prefix_block_size: int = Field(default=0, ge=0, le=4096, strict=True)
    prefix_version: int = Field(default=0, ge=0, le=2**62, strict=True)
    prefix_blocks: list[PrefixDigest] | None = Field(default=None, max_length=MAX_PREFIX_BLOCKS)


class PrefillWarmup(BaseModel):
    """A prefill batch the worker timed at start (``LLMEngine.measure_prefill``): the router's TTFT model uses
    its cost per token (``ms / tokens``) until it has measured the worker's real calls."""

    tokens: int = Field(ge=1, le=1 << 40, strict=True)
    requests: int = Field(ge=1, le=1 << 20, strict=True)
    ms: float = Field(ge=0.0, le=1e9, allow_inf_nan=False)


class DecodeWarmup(BaseModel):
    """Decode steps the worker timed at start (``LLMEngine.measure_decode``): ``ms`` per step at ``batch``
    sequences, ``ms_batch1`` at one. The router's decode-room prior reads the step at the batch decoding now
    off the line through them as the time per output token until a stream has decoded or a request ended."""

    batch: int = Field(ge=1, le=1 << 20, strict=True)
    steps: int = Field(ge=1, le=1 << 20, strict=True)
    ms: float = Field(gt=0.0, le=1e9, allow_inf_nan=False)
    ms_batch1: float = Field(gt=0.0, le=1e9, allow_inf_nan=False)


class RegisterRequest(BaseModel):
    worker_id: str = Field(min_length=1, max_length=128)
    role: Role
    url: str = Field(min_length=1, max_length=512)
    pid: int
    fingerprint: dict[str, Any]
    model_path: str | None = None
    max_model_len: int = Field(ge=1)
    host_id: str = ""
    # GPUs this worker can open CUDA IPC handles of; empty unless it runs on CUDA (cuda_ipc)
    cuda_uuids: list[str] = Field(default_factory=list, max_length=64)
    kv_arena: str = Field(default="", max_length=300)  # its KV lessor's host:port (KV by reference), or ""
    restart_count: int = Field(default=0, ge=0)  # times the launcher restarted this worker id
    memory: dict[str, Any] | None = None  # how it sized its device memory (kv_sizing.KVBudget.to_dict), GPU only
    prefill_warmup: PrefillWarmup | None = None  # its start-up prefill, timed (prefill and colocated workers)
    decode_warmup: DecodeWarmup | None = None  # its start-up decode steps, timed (decode and colocated workers)
    status: WorkerStatus = Field(default_factory=WorkerStatus)


class HeartbeatRequest(BaseModel):
    worker_id: str = Field(min_length=1, max_length=128)
    status: WorkerStatus = Field(default_factory=WorkerStatus)
