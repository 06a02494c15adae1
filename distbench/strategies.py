"""Arrival strategies, registered by name: when each request is due.

An open-loop strategy fixes every send time in advance from the rate and a seed (so a slow server
cannot slow the client down: coordinated omission stays visible). ``closed`` is the closed loop: N users,
each sending its next request when the previous one finished; it has no schedule.
"""

from __future__ import annotations

import random
from collections.abc import Callable

Schedule = Callable[[int, float, float, int], list[float]]  # (n, rate, burstiness, seed) -> offsets (s)
STRATEGIES: dict[str, Schedule | None] = {}


def register(name: str):
    def deco(fn: Schedule) -> Schedule:
        STRATEGIES[name] = fn
        return fn

    return deco


STRATEGIES["closed"] = None  # driven by completions, not a clock


def _gaps(n: int, draw: Callable[[], float]) -> list[float]:
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += draw()
    return out


@register("poisson")
def poisson(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return _gaps(n, lambda: rng.expovariate(rate))


@register("gamma")
def gamma(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Gamma inter-arrival times with shape ``burstiness`` and mean 1/rate (vLLM's --burstiness):
    < 1 burstier than Poisson, 1 = Poisson, > 1 smoother."""
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)
    return _gaps(n, lambda: rng.gammavariate(burstiness, theta))


@register("constant")
def constant(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    return [i / rate for i in range(n)]


def schedule(strategy: str, n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    fn = STRATEGIES.get(strategy)
    if fn is None:
        raise ValueError(
            f"--strategy {strategy!r} has no schedule; open-loop strategies: "
            f"{', '.join(k for k, v in STRATEGIES.items() if v is not None)}"
        )
    return fn(n, rate, burstiness, seed)
