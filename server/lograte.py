"""Rate-limited log lines: one line per cause per period, then one summary of how many were held back.

Under overload the same warning fires per request (a hundred identical lines a second hide the one line
that explains them, and a log can grow by megabytes a second). ``RateLimitedLog`` writes the first line of
a cause at once, counts the repeats within ``period_s``, and writes ``"<cause>: N more like this in the
last P s"`` when the period ends (at the next line of that cause, or at ``flush``, which the router's sweep
calls). A cause is a short key chosen by the caller (e.g. ``"prefill failed on prefill-0"``), not the
whole message: messages name request ids and would never repeat.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass


def describe(e: BaseException) -> str:
    """An exception as ``Type: message``, or its type alone when the message is empty (a bare
    ``TimeoutError`` prints ``''``: an empty reason in a log line explains nothing)."""
    text = str(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


@dataclass
class _Cause:
    since: float
    held: int = 0
    level: int = logging.WARNING


class RateLimitedLog:
    def __init__(
        self, logger: logging.Logger, period_s: float = 5.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.logger, self.period_s, self.clock = logger, period_s, clock
        self._causes: dict[str, _Cause] = {}

    def log(self, level: int, cause: str, msg: str, *args: object) -> bool:
        """Write ``msg % args`` unless ``cause`` was written less than ``period_s`` ago; True if written."""
        now = self.clock()
        c = self._causes.get(cause)
        if c is not None and now - c.since < self.period_s:
            c.held += 1
            return False
        if c is not None and c.held:
            self._summary(cause, c, now)
        self._causes[cause] = _Cause(now, 0, level)
        self.logger.log(level, msg, *args)
        return True

    def warning(self, cause: str, msg: str, *args: object) -> bool:
        return self.log(logging.WARNING, cause, msg, *args)

    def flush(self) -> None:
        """Write the summaries of causes whose period has ended, and forget them."""
        now = self.clock()
        for cause, c in list(self._causes.items()):
            if now - c.since >= self.period_s:
                if c.held:
                    self._summary(cause, c, now)
                del self._causes[cause]

    def _summary(self, cause: str, c: _Cause, now: float) -> None:
        self.logger.log(c.level, "%s: %d more like this in the last %.1f s", cause, c.held, now - c.since)
