"""``n`` and ``best_of``: one client request fanned out as several worker requests (choices).

Choice 0 starts first; the others start when its first token has come, i.e. when its prompt's KV is
in the prefix cache of the worker that prefilled it, so their prefill is mostly a cache hit (full
blocks; the router's least-load pick usually sends them to the same worker when it is the only idle
one). Each choice has its own seed (``choice_seed``): with a seed given, the whole set is reproducible.
Streaming interleaves the choices' chunks as they come, each with its ``index``. With ``best_of > n``
(not streamed, OpenAI's rule) every choice runs to the end and the ``n`` with the highest log
probability per token are returned, indexed 0..n-1 in that order. ``usage`` counts the prompt once and
the tokens of every choice generated (best_of included: they were computed).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from distserve.server.router.logprobs import mean_logprob

_M64 = (1 << 64) - 1


def choice_seed(seed: int, index: int) -> int:
    """Choice 0 keeps the request's seed (n=1 is unchanged); choice i a distinct signed 64-bit seed."""
    if index == 0:
        return seed
    z = (seed + index * 0x9E3779B97F4A7C15) & _M64
    return z - (1 << 64) if z >= 1 << 63 else z


class Choices:
    """The runs (``app._Run``) of one request; ``n`` of them are returned."""

    def __init__(self, runs: list[Any], n: int, batched: bool = False) -> None:
        self.runs = runs
        self.n = n
        self.batched = batched  # one run per prompt of a batched completions request: prompts add up

    @property
    def req(self):
        return self.runs[0].req

    @property
    def error(self) -> str | None:
        return next((r.error for r in self.runs if r.error), None)

    @property
    def error_status(self) -> int:
        return next((r.error_status for r in self.runs if r.error), 500)

    def usage(self) -> dict:
        if len(self.runs) == 1:
            return self.runs[0].usage()
        # n/best_of choices share the prompt (counted once, cached once); a batch's prompts add up
        runs = self.runs if self.batched else self.runs[:1]
        p = sum(len(r.req.prompt_token_ids) for r in runs)
        cached = sum(r.cached_tokens or 0 for r in runs)
        c = sum(len(r.token_ids) for r in self.runs)
        return {
            "prompt_tokens": p,
            "completion_tokens": c,
            "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def chosen(self) -> list[Any]:
        """The runs to return, in index order (after every run ended)."""
        if len(self.runs) == self.n:
            return self.runs
        return sorted(self.runs, key=lambda r: mean_logprob(r.logprobs), reverse=True)[: self.n]

    async def events(self) -> AsyncIterator[tuple[int, Any, str]]:
        """(choice index, TokenEvent, text delta) of every choice as they come; ends after an error."""
        if len(self.runs) == 1:
            async for ev, delta in self.runs[0].events():
                yield 0, ev, delta
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, run) -> None:
            try:
                if i:
                    await self.runs[0].started.wait()
                async for ev, delta in run.events():
                    queue.put_nowait((i, ev, delta))
            finally:
                queue.put_nowait((i, None, ""))

        tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(self.runs)]
        try:
            left = len(tasks)
            while left:
                i, ev, delta = await queue.get()
                if ev is None:
                    left -= 1
                    continue
                yield i, ev, delta
                if ev.error:
                    return
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def collect(self) -> None:
        async for _ in self.events():
            pass
