"""Per-request sampling parameters, validated once at construction.

Errors name the OpenAI field so the HTTP layer can pass them through verbatim. The meaning of each
field (OpenAI's or vLLM's, and the order they apply in) is in ``sampler.py`` and docs/DESIGN.md
"Sampling semantics".
"""

from __future__ import annotations

from dataclasses import dataclass

from distserve.server.engine.structured.grammar import Constraint

# Below this temperature sampling is greedy (vLLM's rule): any logit gap the model can produce is
# scaled past float32's range, so the distribution is one-hot up to exact ties.
SAMPLING_EPS = 1e-5
MAX_LOGPROBS = 20  # OpenAI's top_logprobs bound
MAX_LOGIT_BIAS = 300  # entries of logit_bias (OpenAI's own limit)


def _number(name: str, v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{name} must be a number, got {v!r}")
    return float(v)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_p: float = 0.0  # drop tokens whose probability is below min_p x the top token's (vLLM)
    presence_penalty: float = 0.0  # OpenAI: logit -= presence_penalty if the token was generated
    frequency_penalty: float = 0.0  # OpenAI: logit -= frequency_penalty x times it was generated
    repetition_penalty: float = 1.0  # vLLM/CTRL: a prompt or generated token's logit /rp if > 0 else *rp
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]) added to the logit
    logprobs: int | None = None  # None: none; k: the sampled token's logprob and the k most likely
    structured: Constraint | None = None  # the output's grammar (server/engine/structured), None = free

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ValueError(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool):
            raise ValueError(f"temperature must be a number, got {self.temperature!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool):
            raise ValueError(f"top_p must be a number, got {self.top_p!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not 0.0 <= _number("min_p", self.min_p) <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= _number(name, getattr(self, name)) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < _number("repetition_penalty", self.repetition_penalty) <= 10.0:
            raise ValueError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias must have at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
        for tok, bias in self.logit_bias:
            if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {tok!r}")
            if not -100.0 <= _number("logit_bias", bias) <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias!r}")
        if self.logprobs is not None and (
            isinstance(self.logprobs, bool)
            or not isinstance(self.logprobs, int)
            or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids must be non-negative integers, got {t!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """True when the logits depend on the tokens seen so far (the sampler then counts them)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def to_dict(self) -> dict:
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop_token_ids": list(self.stop_token_ids),
            "ignore_eos": self.ignore_eos,
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "logit_bias": [list(x) for x in self.logit_bias],
            "logprobs": self.logprobs,
            "structured": None if self.structured is None else vars(self.structured),
        }

    @classmethod
    def from_dict(cls, d: dict) -> SamplingParams:
        d = dict(d)
        d["stop_token_ids"] = tuple(d.get("stop_token_ids") or ())
        d["logit_bias"] = tuple((int(t), float(b)) for t, b in d.get("logit_bias") or ())
        if d.get("structured") is not None:
            d["structured"] = Constraint(**d["structured"])
        return cls(**d)
