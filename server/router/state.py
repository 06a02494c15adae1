"""The router's state: one typed object the routes find in ``request.app.state.router``.

It holds what lives as long as the app (config, token, registry, metrics, the pipeline and HTTP session made
in the lifespan, the SLA tracker, admission) and the model the workers serve (tokenizer, chat template, name).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi import Request

from distserve.server.config import DistServeConfig
from distserve.server.engine.chat_template import ChatTemplate
from distserve.server.engine.loader import load_tokenizer, model_display_name, resolve_model_path
from distserve.server.engine.tokenizer import Tokenizer
from distserve.server.lograte import RateLimitedLog
from distserve.server.metrics import RouterMetrics
from distserve.server.router.admission import Admission
from distserve.server.router.backup_pool import BackupPool
from distserve.server.router.control import ControlPlane
from distserve.server.router.fdlimit import ConnectionCounter
from distserve.server.router.identity import WorkerIdentities
from distserve.server.router.pipeline import NoWorkersError, Pipeline
from distserve.server.router.registry import WorkerRegistry
from distserve.server.router.sla_live import SlaLive
from distserve.server.router.structured_outputs import GrammarCheck

log = logging.getLogger(__name__)


@dataclass
class RouterState:
    config: DistServeConfig
    token: str
    registry: WorkerRegistry
    metrics: RouterMetrics = field(default_factory=RouterMetrics)
    served_model_name: str | None = None
    model_path: str | None = None
    tokenizer: Tokenizer | None = None
    chat_template: ChatTemplate | None = None
    pipeline: Pipeline | None = None
    sla: SlaLive | None = None  # rolling percentiles, breaker, journals (server/router/sla_live.py)
    backup: BackupPool | None = None
    grammar_check: GrammarCheck = field(default_factory=GrammarCheck)  # structured outputs: compile verdicts
    created: int = field(default_factory=lambda: int(time.time()))  # /v1/models `created`
    admission: Admission | None = None  # bounded queues, SLO-aware admission (server/router/admission.py)
    connections: ConnectionCounter | None = None  # open client connections vs the fd budget (fdlimit.py)
    identities: WorkerIdentities | None = None  # per-worker credentials (server/router/identity.py)
    control: ControlPlane | None = None  # heartbeats' own thread and port (server/router/control.py)
    # (listening socket, uvicorn protocol factory) of the main port, when the control thread accepts on it
    # and answers /health there (``FrontDoor``); set by ``serve_router``, None in tests that drive the app alone
    front_door: tuple[socket.socket, Callable[[], asyncio.Protocol]] | None = None
    overload_log: RateLimitedLog = field(default_factory=lambda: RateLimitedLog(log))  # a line per admission cause

    def ids(self) -> WorkerIdentities:
        if self.identities is None:
            self.identities = WorkerIdentities(self.token)
        return self.identities

    _tokenizer_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def running_pipeline(self) -> Pipeline:
        """The pipeline, which exists while the app runs (made in its lifespan, with the HTTP session)."""
        if self.pipeline is None:
            raise RuntimeError("the router's pipeline is not running (app not started)")
        return self.pipeline

    def warm_tokenizer(self) -> None:
        try:
            self.get_tokenizer()
        except Exception as e:  # the first request reports it properly
            log.warning("cannot load the tokenizer yet: %s", e)
            return
        gc.freeze()  # its vocabulary lives as long as the router: out of every later full collection

    def get_tokenizer(self) -> Tokenizer:
        if self.tokenizer is not None:
            return self.tokenizer
        with self._tokenizer_lock:  # a GGUF vocabulary takes a second or more to build: build it once
            return self._load_tokenizer()

    def _load_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            path = self.model_path or self.registry.model_path()
            if path is None and not self.registry.workers:
                raise NoWorkersError("no worker has registered a model yet")
            if path is None or str(path).startswith("preset:"):  # shape presets (no files): byte tokenizer
                self.tokenizer = Tokenizer.byte_tokenizer()
            else:
                self.tokenizer = load_tokenizer(resolve_model_path(path))  # a name, a folder or a .gguf
                self.model_path = path
        return self.tokenizer

    def get_chat_template(self) -> ChatTemplate:
        if self.chat_template is None:
            self.chat_template = ChatTemplate.for_tokenizer(self.get_tokenizer())
        return self.chat_template

    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return model_display_name(self.model_path or self.registry.model_path())

    def check_model(self, requested: str | None) -> None:
        """A request may name the served model (or the ``--model`` it was started with), or no model."""
        if requested is None or requested == self.model_name():
            return
        if self.model_path is not None and requested == str(self.model_path):
            return
        raise ModelNotFound(requested)

    def max_prompt_chars(self) -> int:
        return self.config.router.max_prompt_chars or 32 * self.max_seq_len()

    def max_seq_len(self) -> int:
        lens = [self.config.prefill.max_seq_len]
        worker_len = self.registry.max_model_len()
        if worker_len:
            lens.append(worker_len)
        return min(lens)


class ModelNotFound(Exception):
    """OpenAI's answer to a request that names a model this server does not serve: 404 model_not_found."""


def router_state(request: Request) -> RouterState:
    """The state of the app serving ``request`` (set by ``create_router_app``)."""
    state: RouterState = request.app.state.router
    return state


def prefill_priors(state: RouterState) -> dict[str, float]:
    """The start-up cost per prompt token (ms) each healthy worker sharing the prefill queue reported at
    registration (``prefill_warmup``): the TTFT model's cold-start prior."""
    reg = state.registry
    role = "prefill" if reg.mode() == "disaggregated" else "colocated"
    return {
        w.worker_id: w.prefill_warmup["ms"] / w.prefill_warmup["tokens"]
        for w in reg.workers.values()  # no sweep: the prediction's hot path reads it (serving_workers sweeps)
        if w.role == role and w.healthy and w.prefill_warmup is not None
    }


def decode_step_prior_s(state: RouterState, holders: int) -> float | None:
    """The decode step (seconds) at ``holders`` sequences per worker, read off the line through the two steps
    each healthy worker that decodes (decode workers when disaggregated, else colocated ones) timed at start
    (``decode_warmup``: at one sequence and at ``batch``; extrapolated beyond it, never below the first),
    on average: the decode-room prior's time per output token before any stream has decoded and any request
    has ended. None when none reported one."""
    reg = state.registry
    role = "decode" if reg.mode() == "disaggregated" else "colocated"
    ws = [w.decode_warmup for w in reg.workers.values() if w.role == role and w.healthy and w.decode_warmup]
    if not ws:
        return None
    b = max(1.0, holders / len(ws))
    ms = []
    for d in ws:
        slope = (d["ms"] - d["ms_batch1"]) / (d["batch"] - 1) if d["batch"] > 1 else 0.0
        ms.append(d["ms_batch1"] + max(0.0, slope) * (b - 1))
    return sum(ms) / len(ms) / 1000.0


def serving_workers(state: RouterState) -> int:
    """How many workers share the prefill queue: healthy prefill workers, else healthy colocated ones."""
    reg = state.registry
    return len(reg.healthy("prefill")) if reg.mode() == "disaggregated" else len(reg.healthy("colocated"))
