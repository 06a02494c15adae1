"""One request's run through the pipeline as the router sees it: its tokens, text and timings, the metrics,
admission and SLA records it leaves when it ends, and (chat with tools) how its answer becomes tool calls."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from distserve.server.router import protocol, tool_calls
from distserve.server.router.admission import Ticket
from distserve.server.router.pipeline import EngineRequest, NoWorkersError, TokenEvent
from distserve.server.router.protocol import InvalidRequest
from distserve.server.router.request_journal import client_fault
from distserve.server.router.sla_live import Finished
from distserve.server.router.state import RouterState
from distserve.server.router.text import TextAssembler

log = logging.getLogger(__name__)

_OUTCOME_STATUS = {"ok": 200, "rejected": 400, "aborted": 499, "unavailable": 503}  # journal's "status"


class Run:
    """One request's progress: tokens, text, timings; records metrics when it ends."""

    def __init__(
        self, state: RouterState, req: EngineRequest, text: TextAssembler, ticket: Ticket | None = None
    ) -> None:
        self.state, self.req, self.assembler = state, req, text
        self.ticket = ticket  # its place in admission's counts: released at token #1 and at the end
        req.phases = ticket.phases if ticket is not None else req.phases  # measured for its TTFT model
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.error_status = 500  # HTTP status of `error` when the response has not started
        self.first_token_at: float | None = None
        self.last_event_at: float | None = None
        self.itl: list[float] = []
        self.cached_tokens: int | None = None  # prompt tokens the prefilling worker's prefix cache served
        self.tools: ToolContext | None = None  # tool calls requested (chat with tools)
        self.logprobs: list = []  # wire TokenLogprob per token, when the request asked for logprobs
        self.started = asyncio.Event()  # set at the first event (choices.py starts the other choices then)

    async def events(self) -> AsyncIterator[tuple[TokenEvent, str]]:
        m = self.state.metrics
        m.running.inc()
        status = "aborted"
        try:
            async with aclosing(self.state.running_pipeline().generate(self.req)) as stream:
                async for ev in stream:
                    self.started.set()
                    now = time.perf_counter()
                    if ev.token_ids:
                        if self.first_token_at is None:
                            self.first_token_at = now
                            m.ttft.observe(now - self.req.arrival)
                            if self.ticket is not None:
                                self.ticket.first_token(now - self.req.arrival)
                        elif self.last_event_at is not None:
                            m.itl.observe(now - self.last_event_at)
                            self.itl.append(now - self.last_event_at)
                        self.last_event_at = now
                    self.token_ids.extend(ev.token_ids)
                    if self.ticket is not None:
                        self.ticket.streamed = len(self.token_ids)  # the room prior's tokens left
                    if self.cached_tokens is None and ev.num_cached_tokens is not None:
                        self.cached_tokens = ev.num_cached_tokens  # the first prefill's (a migration re-prefills)
                    if ev.logprobs:
                        self.logprobs.extend(ev.logprobs)
                    if ev.error:
                        self.error, status = ev.error, "error"
                        self.finish_reason = "error"
                        yield ev, ""
                        return
                    delta = self.assembler.push(ev.token_ids, final=ev.finished)
                    if self.assembler.stopped:
                        self.finish_reason = "stop"
                        status = "ok"
                        yield TokenEvent(ev.token_ids, True, "stop", logprobs=ev.logprobs), delta
                        return  # closing the pipeline closes the worker stream: it aborts and frees KV
                    if ev.finished:
                        if ev.finish_reason not in ("stop", "length"):  # a worker aborted it without saying why
                            self.error = f"request ended early ({ev.finish_reason}) on the worker"
                            self.finish_reason, status = "error", "error"
                            yield TokenEvent(ev.token_ids, True, "error", self.error), ""
                            return
                        self.finish_reason = ev.finish_reason
                        status = "ok"
                    yield ev, delta
                    if ev.finished:
                        return
        except NoWorkersError as e:
            self.error, status, self.finish_reason = f"{e}", "unavailable", "error"
            self.error_status = 503
            yield TokenEvent([], True, "error", self.error), ""
        except (InvalidRequest, ValueError) as e:  # a worker's 400 (validation it does and we did not)
            # the client's fault: "rejected", like the router's own 400s, and not an SLA failure
            self.error, status, self.finish_reason = f"{e}", "rejected", "error"
            self.error_status = 400
            yield TokenEvent([], True, "error", self.error), ""
        except Exception as e:  # a bug: still end the stream with an error the client can read
            log.exception("request %s failed", self.req.request_id)
            self.error, status, self.finish_reason = f"internal error: {type(e).__name__}: {e}", "error", "error"
            yield TokenEvent([], True, "error", self.error), ""
        finally:
            self.started.set()
            m.running.dec()
            m.requests.labels(status).inc()
            if self.ticket is not None:
                n = len(self.token_ids)
                first = self.first_token_at
                tpot = (time.perf_counter() - first) / (n - 1) if status == "ok" and first and n > 1 else None
                self.ticket.done(tpot)
            if status == "ok":
                e2e = time.perf_counter() - self.req.arrival
                m.e2e.observe(e2e)
                m.prompt_tokens.inc(len(self.req.prompt_token_ids))
                m.generation_tokens.inc(len(self.token_ids))
                if self.first_token_at is not None and len(self.token_ids) > 1:
                    m.tpot.observe((time.perf_counter() - self.first_token_at) / (len(self.token_ids) - 1))
            # journaled whatever the outcome; a client that left (499) or a request the worker refused as
            # invalid (400) is not a server failure: the audit leaves them out of availability
            if self.state.sla is not None:
                self._record_sla(status)

    def _record_sla(self, status: str) -> None:
        sla = self.state.sla
        if sla is None:
            return
        now = time.perf_counter()
        ok, n = status == "ok", len(self.token_ids)
        first = self.first_token_at
        ttft = first - self.req.arrival if ok and first is not None else None
        tpot = (now - first) / (n - 1) if ok and first is not None and n > 1 else None
        sla.record(
            Finished(
                "primary",
                time.monotonic() - (now - self.req.arrival),
                time.time() - (now - self.req.arrival),
                ok,
                ttft=ttft,
                tpot=tpot,
                e2e=now - self.req.arrival if ok else None,
                itl=tuple(self.itl) if ok else (),
                prompt_tokens=len(self.req.prompt_token_ids),
                output_tokens=n,
                error=None
                if ok
                else (self.error or ((client_fault() or "client disconnected") if status == "aborted" else status)),
                http_status=_OUTCOME_STATUS.get(status, 500),
                predicted_ttft=self.ticket.predicted_ttft_s if self.ticket is not None else None,
                path=self.req.path,
                ttft_parts=self.ticket.phases.journal(ttft) if self.ticket is not None else None,
            )
        )

    async def collect(self) -> None:
        async for _ in self.events():
            pass

    def usage(self) -> dict:
        p, c = len(self.req.prompt_token_ids), len(self.token_ids)
        return {
            "prompt_tokens": p,
            "completion_tokens": c,
            "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens or 0},
        }


@dataclass
class ToolContext:
    """A chat request with tools: how its answer becomes ``tool_calls`` (server/router/tool_calls.py)."""

    req: protocol.ChatCompletionRequest
    mode: str  # auto | required | named
    family: str  # the parser of the template's family (auto)
    stop_ids: set[int]

    def answer(self, run: Run) -> tuple[str | None, list[tool_calls.ParsedCall]]:
        """(content, calls) of a finished run."""
        if self.mode == "auto":
            content, calls = tool_calls.parse_auto(self.raw_text(run), self.family, self._names())
            if not self.req.parallel_tool_calls:
                calls = calls[:1]
            return (content or None) if calls else run.assembler.text, calls
        calls = tool_calls.parse_constrained(run.assembler.text, self.req)
        return None, calls

    def raw_text(self, run: Run) -> str:
        """The answer with special tokens (tool-call markers may be special), end-of-turn tokens left out."""
        ids = [t for t in run.token_ids if t not in self.stop_ids]
        return run.state.get_tokenizer().decode(ids, skip_special_tokens=False)

    def _names(self) -> set[str]:
        return {t.function.name for t in self.req.tools or ()}
