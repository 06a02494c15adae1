"""The per-request record: one definition for the generator, the statistics, the SLA audit and bench/.

A result file keeps every record under the key ``requests`` (``RequestRecord.to_dict``); every figure in
the result can be recomputed from them. Times are seconds. ``scheduled`` and ``sent`` are offsets from
the run's start (``perf_counter``); ``start_unix`` is the wall-clock time of the scheduled send, so an SLA
audit can window records by time. The schema is documented in docs/DISTBENCH.md; keep the keys stable.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

SCHEMA_VERSION = 1
CANCELLED = "cancelled"  # the prefix of a cancelled request's `error`
RATE_LIMITED = "HTTP 429"  # the prefix of a rate-limited request's `error`


@dataclass
class RequestRecord:
    index: int
    scheduled: float  # when the strategy wanted it sent (s from run start); closed loop: == sent
    sent: float = 0.0  # when it was actually sent
    start_unix: float = 0.0  # wall clock of `scheduled`
    ttft: float | None = None  # first token - scheduled (open loop: includes the client's lateness)
    ttft_service: float | None = None  # first token - sent
    e2e: float | None = None  # last byte - scheduled
    itl: list[float] = field(default_factory=list)  # gaps between successive token chunks
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None  # None, or "HTTP 404: first words of the body", "ClientConnectorError: ..."
    warmup: bool = False  # excluded from every figure
    session: int | None = None  # multi-turn: conversation id
    turn: int | None = None
    backoff: float = 0.0  # closed loop: seconds this user waited after a fast failure before sending it
    cancelled_after: float | None = None  # cancelled at the stop: seconds from `scheduled` to the cancel
    retry_after: float | None = None  # a 429's Retry-After header, seconds (None: not a 429, or no header)

    @property
    def cancelled(self) -> bool:
        """In flight when the run stopped (Ctrl-C, --duration's drain ran out): neither a success nor a failure."""
        return self.error is not None and self.error.startswith(CANCELLED)

    @property
    def rate_limited(self) -> bool:
        """Refused with 429 (the server's admission at capacity): neither a success nor a failure."""
        return self.error is not None and self.error.startswith(RATE_LIMITED)

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft is not None and self.e2e is not None

    @property
    def late(self) -> float:
        """How far behind its schedule the request went out (coordinated omission's size)."""
        return max(0.0, self.sent - self.scheduled)

    @property
    def e2e_service(self) -> float | None:
        return None if self.e2e is None else self.e2e - (self.sent - self.scheduled)

    @property
    def tpot(self) -> float | None:
        """(last token - first token) / (output tokens - 1), vLLM's definition; None below 2 tokens."""
        if self.e2e is None or self.ttft is None or self.error is not None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tpot"] = self.tpot
        return d

    @classmethod
    def from_dict(cls, d: dict) -> RequestRecord:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def parse_retry_after(value: str | None) -> float | None:
    """Retry-After in seconds (delta-seconds form; an HTTP date or garbage: None)."""
    if value is None:
        return None
    try:
        s = float(value.strip())
    except ValueError:
        return None
    return s if s >= 0 and s == s and s != float("inf") else None


def short_error(status: int | None, body: str = "", exc: BaseException | None = None, words: int = 12) -> str:
    """'HTTP 404: {"detail":"Not Found"}' — status and the first words of the body, one line."""
    if exc is not None:
        text = str(exc) or ""
        return f"{type(exc).__name__}: {' '.join(text.split()[:words])}".rstrip(": ")
    return f"HTTP {status}: {' '.join(body.split()[:words])}".rstrip(": ")
