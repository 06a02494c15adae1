"""Token ids → streamed text, with OpenAI stop strings.

While streaming, text that could still be the beginning of a stop string is
held back (at most ``max(len(stop)) - 1`` characters), so a client never sees
part of a stop string that later turns out to end the completion.
"""

from __future__ import annotations

from distserve.server.engine.tokenizer import Tokenizer


class TextAssembler:
    def __init__(self, tokenizer: Tokenizer, stop: list[str]) -> None:
        self._detok = tokenizer.incremental_detokenizer()
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._pending = ""  # decoded but not yet emitted
        self.text = ""  # everything emitted so far
        self.stopped = False

    def push(self, token_ids: list[int], final: bool = False) -> str:
        """Text to emit for these tokens. After a stop string matched, ``stopped`` is True."""
        if self.stopped:
            return ""
        self._pending += self._detok.push_many(token_ids)
        if final:
            self._pending += self._detok.flush()
        if self._stop:
            cut = min((i for i in (self._pending.find(s) for s in self._stop) if i >= 0), default=-1)
            if cut >= 0:
                self.stopped = True
                out, self._pending = self._pending[:cut], ""
                self.text += out
                return out
        keep = 0 if final else min(self._hold, len(self._pending))
        out = self._pending[: len(self._pending) - keep]
        self._pending = self._pending[len(out) :]
        self.text += out
        return out
