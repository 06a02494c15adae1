"""One engine's constrained decoding: compiled grammars (cached), per-request matchers, the step's mask.

The engine makes four calls: ``add`` when a request enters (the matcher replays the tokens the
request already has — token #1 from a prefill worker, or everything before a migration — so a
matcher is rebuilt from tokens wherever the request lands), ``mask_logits`` between the forward
and the sampler, ``accept`` per sampled token, ``remove`` when the request leaves.

The mask of every constrained row of a step is computed on the host into one int32 bitmask
(llguidance's parallel executor fills the rows on its own threads, the GIL released), copied to
the logits' device in one transfer, unpacked and applied there for all rows at once: no per-row
device sync. Unconstrained rows are not touched. Disallowed logits are set to ``MASKED``, a finite
value far below any logit, so the sampler's non-finite-row check (a NaN/Inf row fails its request)
still means what it says.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from distserve.server.engine.structured.grammar import Constraint, GrammarError, to_grammar

if TYPE_CHECKING:
    from distserve.server.engine.sequence import Sequence
    from distserve.server.engine.tokenizer import Tokenizer

MASKED = -1e30  # a disallowed token's logit: exp() underflows to 0, the row sum stays finite
CACHE_SIZE = 256  # compiled grammars kept per engine (least recently used dropped)
PARALLEL_FROM = 8  # constrained rows in a step from which llguidance's thread pool fills the masks


def unpack_on_host(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, words] int32 bitmask (bit i of word w = token 32 w + i) → [rows, vocab] bool, in one C pass."""
    packed = bitmask.view(torch.uint8).numpy()  # little-endian words: byte and bit order agree
    return torch.from_numpy(np.unpackbits(packed, axis=1, bitorder="little")[:, :vocab].view(np.bool_))


def unpack_on_device(bits: torch.Tensor, vocab: int, shifts: torch.Tensor) -> torch.Tensor:
    """As ``unpack_on_host``, with tensor ops on the bitmask's device (``shifts``: arange(32) int32 there)."""
    n, words = bits.shape
    return ((bits.unsqueeze(-1) >> shifts) & 1).view(n, words * 32)[:, :vocab].bool()


class _TokenizerView:
    """Our ``Tokenizer`` in the shape llguidance's ``TokenizerWrapper`` reads: one byte string per id
    (special tokens prefixed with 0xff, llguidance's convention), eos, bos, and ``encode``."""

    def __init__(self, tok: Tokenizer, vocab_size: int) -> None:
        table = tok._table  # bytes of each token id, as the detokenizer uses them
        if table is None:
            raise GrammarError("structured outputs need a byte-level or byte-fallback tokenizer")
        tokens = list(table) + [b""] * max(0, vocab_size - len(table))
        for i in tok.special_token_ids:
            if i < len(tokens):
                tokens[i] = b"\xff" + (tok.id_to_token(i) or f"<special_{i}>").encode()
        self.tokens = tokens[:vocab_size]
        self.eos_token_id = tok.eos_token_id
        self.bos_token_id = tok.bos_token_id
        self.special_token_ids = sorted(tok.special_token_ids)
        self.is_tokenizer_wrapper = True
        self._tok = tok

    def __call__(self, s: str | bytes) -> list[int]:
        if isinstance(s, bytes):
            s = s.decode("utf-8", errors="replace")
        return self._tok.encode(s, add_bos=False)


class StructuredDecoding:
    def __init__(self, load_tokenizer: Callable[[], Tokenizer], vocab_size: int, eos_token_ids: list[int]) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._lltok: Any = None
        self._executor: Any = None
        self._lock = threading.Lock()  # the cache is filled off the event loop (prepare) and read by the engine
        self._compiled: OrderedDict[Constraint, Any] = OrderedDict()
        self._matchers: dict[str, Any] = {}
        self._bitmask: torch.Tensor | None = None
        self._shifts: dict[torch.device, torch.Tensor] = {}
        self.num_compiled = 0  # grammars compiled (cache misses)

    # --- compilation (any thread) ----------------------------------------------
    def _tokenizer(self) -> Any:
        if self._lltok is None:
            import llguidance

            view = _TokenizerView(self._load_tokenizer(), self.vocab_size)
            eos = [t for t in self.eos_token_ids if t < self.vocab_size] or view.eos_token_id
            self._lltok = llguidance.LLTokenizer(
                llguidance.TokenizerWrapper(view), n_vocab=self.vocab_size, eos_token=eos
            )
            self._executor = llguidance.LLExecutor()
        return self._lltok

    def prepare(self, c: Constraint) -> Any:
        """The compiled matcher for ``c`` (compiled once, then from the cache); GrammarError if it cannot be."""
        with self._lock:
            m = self._compiled.get(c)
            if m is not None:
                self._compiled.move_to_end(c)
                return m
            import llguidance

            m = llguidance.LLMatcher(self._tokenizer(), to_grammar(c), log_level=0)
            if m.is_error():
                raise GrammarError(m.get_error())
            self._compiled[c] = m
            self.num_compiled += 1
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
            return m

    # --- per request (engine thread) ---------------------------------------------
    def add(self, seq: Sequence) -> None:
        c = seq.sampling_params.structured
        if c is None:
            return
        m = self.prepare(c).deep_copy()
        if seq.output_token_ids and not m.consume_tokens(list(seq.output_token_ids)):
            raise GrammarError(f"the tokens generated so far do not follow the grammar: {m.get_error()}")
        self._matchers[seq.request_id] = m

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    @torch.inference_mode()  # the forward's logits are inference tensors: updated in place only in this mode
    def mask_logits(self, logits: torch.Tensor | None, seqs: list[Sequence]) -> None:
        """Mask, in place, the rows of ``logits`` (one per entry of ``seqs``) whose request is constrained."""
        if not self._matchers or logits is None:
            return
        rows = [(i, m) for i, s in enumerate(seqs) if (m := self._matchers.get(s.request_id)) is not None]
        if not rows:
            return
        n, vocab = len(rows), logits.shape[-1]
        words = (self.vocab_size + 31) // 32
        if self._bitmask is None or self._bitmask.shape[0] < n:
            self._bitmask = torch.empty((max(n, 8), words), dtype=torch.int32)
        bitmask = self._bitmask[:n]
        ptr, nbytes = bitmask.data_ptr(), words * 4
        dev = logits.device
        # llguidance's thread pool only where host cores are otherwise idle (a GPU worker); a CPU worker owns
        # one core, which the pool's threads would take from the forward
        # (measured: docs/performance/structured-outputs.md, "The grammar engines")
        if n < PARALLEL_FROM or dev.type == "cpu":
            for k, (_, m) in enumerate(rows):
                m.unsafe_compute_mask_ptr(ptr + k * nbytes, nbytes)
        else:
            self._executor.unsafe_compute_mask_ptr([(m, k) for k, (_, m) in enumerate(rows)], ptr, nbytes, n)
        if dev.type == "cpu":
            allowed = unpack_on_host(bitmask, vocab)
        else:
            shifts = self._shifts.get(dev)
            if shifts is None:
                shifts = self._shifts[dev] = torch.arange(32, dtype=torch.int32, device=dev)
            allowed = unpack_on_device(bitmask.to(dev, non_blocking=True), vocab, shifts)
        if n == logits.shape[0]:
            logits.masked_fill_(~allowed, MASKED)
            return
        idx = torch.tensor([i for i, _ in rows], device=dev)
        sub = logits.index_select(0, idx).masked_fill_(~allowed, MASKED)
        logits.index_copy_(0, idx, sub)

    def accept(self, seq: Sequence, token: int) -> bool | str:
        """Advance ``seq``'s matcher by ``token``: True once the grammar is complete (nothing may follow),
        False to go on, or a sentence when the token breaks the grammar (the request fails)."""
        m = self._matchers.get(seq.request_id)
        if m is None:
            return False
        if not m.consume_token(token):
            return f"the grammar engine refused token {token}: {m.get_error()}"
        return bool(m.is_stopped())
