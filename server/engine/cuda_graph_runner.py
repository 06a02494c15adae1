"""CUDA graphs for pure-decode steps, and the GPU set-up of an engine.

A decode step of a 7B model is ~300 kernels whose GPU time is a few
microseconds each; launched one by one from Python they cost far more than
they run (Hugging Face eager decode: ~90 ms/step on an H200 whose bandwidth
floor is ~3.2 ms). ``CudaGraphRunner`` captures the model's decode forward once
per batch size (1, 2, 4, 8, ... up to the engine's ``max_num_seqs``) over static
input buffers, and a decode step becomes: fill one pinned host buffer, two
host-to-device copies, one graph replay.

Static inputs (one int64 device buffer, views into it): input ids, positions,
slot mapping, sequence lengths, and block tables padded to the width of
``max_model_len``. A batch of ``n`` runs in the graph of the next captured size
``bs >= n``; padding rows get slot -1 (the KV write skips it), length 1 and
position 0, and their logits are dropped. Inside the captured region nothing
reads a device value on the host: the decode kernel's grid and partition size
come from the static table width (see ``triton_decode.plan_splits``).

``ModelRunner.execute`` asks ``graph_runner.execute(scheduled)`` first; it
returns ``None`` (eager fallback) for anything but an all-decode step that fits.
"""

from __future__ import annotations

import logging
import os

import torch

from distserve.server.engine.attention import AttentionMetadata

log = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def capture_sizes(max_batch_size: int, sizes=DEFAULT_BATCH_SIZES) -> list[int]:
    out = [s for s in sizes if s < max_batch_size]
    bigger = [s for s in sizes if s >= max_batch_size]
    out.append(bigger[0] if bigger else max_batch_size)
    return sorted(set(out))


class CudaGraphRunner:
    def __init__(
        self,
        runner,
        max_model_len: int,
        batch_sizes: list[int] | None = None,
        max_batch_size: int = 64,
        use_graphs: bool | None = None,
    ) -> None:
        self.runner = runner
        self.model = runner.model
        self.device = runner.device
        self.block_size = runner.block_size
        self.max_model_len = max_model_len
        self.batch_sizes = sorted(set(batch_sizes)) if batch_sizes else capture_sizes(max_batch_size)
        self.max_bs = self.batch_sizes[-1]
        self.width = -(-max_model_len // self.block_size)  # block-table width
        # Off the GPU (tests), "graphs" are the same static-buffer forward run eagerly.
        self.use_graphs = (self.device.type == "cuda") if use_graphs is None else use_graphs
        b, w = self.max_bs, self.width
        n = 4 * b + b * w
        self._static = torch.zeros(n, dtype=torch.long, device=self.device)
        self._host = torch.zeros(n, dtype=torch.long, pin_memory=self.device.type == "cuda")
        self._host_np = self._host.numpy()
        self._copy_done = torch.cuda.Event() if self.device.type == "cuda" else None
        st = self._static
        self.input_ids, self.positions = st[0:b], st[b : 2 * b]
        self.slot_mapping, self.seq_lens = st[2 * b : 3 * b], st[3 * b : 4 * b]
        self.block_tables = st[4 * b :].view(b, w)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.num_replays = 0
        self._rows: list = [None] * self.max_bs  # (block-table list, its length) last written to each host row
        self.capture()

    # --- capture ---------------------------------------------------------------
    def _forward(self, bs: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            block_size=self.block_size,
            prefill_query_lens=[],
            prefill_seq_lens=[],
            prefill_block_tables=[],
            decode_seq_lens=self.seq_lens[:bs],
            decode_block_tables=self.block_tables[:bs],
            decode_max_seq_len=self.width * self.block_size,
        )
        hidden = self.model(
            self.input_ids[:bs], self.positions[:bs], self.runner.kv_caches, meta, self.max_model_len - 1
        )
        return self.model.compute_logits(hidden)

    def _reset_inputs(self) -> None:
        self.input_ids.zero_()
        self.positions.zero_()
        self.slot_mapping.fill_(-1)
        self.seq_lens.fill_(1)
        self.block_tables.zero_()

    @torch.inference_mode()
    def capture(self) -> None:
        self._reset_inputs()
        if not self.use_graphs:
            return
        pool = None
        stream = torch.cuda.Stream(device=self.device)
        for bs in sorted(self.batch_sizes, reverse=True):
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):  # warm-up: JIT-compiles every kernel variant of this size
                for _ in range(2):
                    self._forward(bs)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                out = self._forward(bs)
            pool = graph.pool()
            self.graphs[bs] = graph
            self.outputs[bs] = out
        torch.cuda.synchronize(self.device)
        log.info("captured CUDA graphs for decode batch sizes %s", self.batch_sizes)

    # --- execution -------------------------------------------------------------
    def padded_size(self, n: int) -> int | None:
        for bs in self.batch_sizes:
            if bs >= n:
                return bs
        return None

    def can_run(self, scheduled) -> bool:
        n = len(scheduled)
        if n == 0 or n > self.max_bs:
            return False
        for s in scheduled:
            if s.num_new_tokens != 1 or not s.samples or len(s.seq.block_table) > self.width:
                return False
        return True

    @torch.inference_mode()
    def execute(self, scheduled) -> torch.Tensor | None:
        """Float32 logits ``[n, vocab]`` for an all-decode step, or None (run it eagerly)."""
        if not self.can_run(scheduled):
            return None
        n = len(scheduled)
        bs = self.padded_size(n)
        if bs is None:  # can_run said yes, so a captured size fits; kept as a guard
            return None
        b, w, bsz = self.max_bs, self.width, self.block_size
        if self._copy_done is not None:
            self._copy_done.synchronize()  # the previous step's copy has left the pinned buffer
        h = self._host_np
        tables = h[4 * b :].reshape(b, w)
        for i, s in enumerate(scheduled):
            seq = s.seq
            pos = seq.num_computed_tokens
            bt = seq.block_table
            plen = len(seq.prompt_token_ids)  # (not all_token_ids: that copies the whole list)
            h[i] = seq.prompt_token_ids[pos] if pos < plen else seq.output_token_ids[pos - plen]
            h[b + i] = pos
            h[2 * b + i] = bt[pos // bsz] * bsz + pos % bsz
            h[3 * b + i] = pos + 1
            prev = self._rows[i]
            # A table list only ever grows in place; freeing (preemption) or claiming a cached prefix
            # gives the sequence a *new* list, possibly of the same length with other block ids. So the
            # row is rewritten when the list object or its length changed (holding the list keeps its
            # identity unique).
            if prev is None or prev[0] is not bt or prev[1] != len(bt):
                tables[i, : len(bt)] = bt
                self._rows[i] = (bt, len(bt))
        if bs > n:
            h[n:bs] = 0
            h[b + n : b + bs] = 0
            h[2 * b + n : 2 * b + bs] = -1
            h[3 * b + n : 3 * b + bs] = 1
            tables[n:bs, 0] = 0
            self._rows[n:bs] = [None] * (bs - n)
        self._static[: 4 * b].copy_(self._host[: 4 * b], non_blocking=True)
        self._static[4 * b : 4 * b + bs * w].copy_(self._host[4 * b : 4 * b + bs * w], non_blocking=True)
        if self._copy_done is not None:
            self._copy_done.record()
        self.num_replays += 1
        if self.use_graphs:
            self.graphs[bs].replay()
            return self.outputs[bs][:n]
        return self._forward(bs)[:n]


def setup_cuda_engine(engine, phase: str = "final") -> None:
    """GPU set-up of an ``LLMEngine`` whose model was built with its op set (``layer_ops.select_layer_ops``).

    ``phase`` "measure": over the profiling cache, before the KV pool is sized (``memory_profile``): the
    kernel tunings that need no pool (one-token GEMV, FP8 linears; done once, their choices stay on the
    model), then the decode and sampler CUDA graphs, which the caller measures and releases. "final": over
    the real pool: the paged-decode tuning (it reads a real cache) and the graphs again.

    A prefill engine (``config.decode_graphs`` False) runs no decode steps: no decode graphs and no decode
    kernel tuning; its token-1 sampling still gets the sampler's graphs."""
    if phase not in ("measure", "final"):
        raise ValueError(f"phase must be measure or final, got {phase!r}")
    decodes = engine.config.decode_graphs
    tuned: set = engine._tuned
    fused = engine.model.ops.name == "triton"
    if fused and decodes and "gemv" not in tuned and os.environ.get("DISTSERVE_GEMV_TUNE", "1") != "0":
        from distserve.server.engine.ops.cuda_ops import tune_gemv

        engine.gemv_report = tune_gemv(engine.model)  # one-token GEMV: Triton where it beats cuBLAS
        tuned.add("gemv")
    fp8 = engine.model.ops.name == "triton+fp8"
    if fp8 and "fp8" not in tuned and os.environ.get("DISTSERVE_FP8_TUNE", "1") != "0":
        from distserve.server.engine.fp8_linear import tune_fp8_linears

        engine.fp8_report = tune_fp8_linears(engine.model)  # e4m3 GEMV / split-K configs per shape
        tuned.add("fp8")
    backend = engine.model.backend
    if (
        phase == "final"
        and decodes
        and hasattr(backend, "decode_configs")
        and os.environ.get("DISTSERVE_DECODE_TUNE", "1") != "0"
    ):
        from distserve.server.engine.attention.triton_decode import tune_decode_configs

        backend.decode_configs, engine.decode_report = tune_decode_configs(  # paged decode tile / warps
            engine.runner.kv_caches[0],
            engine.model_config.num_attention_heads,
            engine.config.block_size,
            engine.model.embed_tokens.weight.dtype,
        )
        tuned.add("decode")
        torch.cuda.empty_cache()  # its scratch graphs and tensors
    graphs = None
    eager = engine.config.enforce_eager
    if decodes and not eager and getattr(backend, "supports_cuda_graph", False):
        graphs = CudaGraphRunner(engine.runner, engine.max_model_len, max_batch_size=engine.config.max_num_seqs)
        engine.runner.graph_runner = graphs
    if not eager and os.environ.get("DISTSERVE_GRAPH_SAMPLER", "1") != "0":
        attach_graph_sampler(engine, graphs.batch_sizes if graphs else capture_sizes(engine.config.max_num_seqs))
    log.info(
        "GPU engine (%s): backend=%s layer_ops=%s cuda_graphs=%s sampler_graphs=%s",
        phase,
        engine.model.backend.name,
        engine.model.ops.name,
        graphs.batch_sizes if graphs else None,
        getattr(engine.sampler.graphs, "batch_sizes", None),
    )


def attach_graph_sampler(engine, batch_sizes: list[int]) -> None:
    """The engine's sampler draws through CUDA graphs (graph_sampler.py) for the sizes that fit."""
    from distserve.server.engine.graph_sampler import MAX_ELEMENTS, GraphSampler
    from distserve.server.engine.sampler import Sampler

    vocab = engine.model_config.vocab_size
    sizes = [b for b in batch_sizes if b * vocab <= MAX_ELEMENTS]
    if not sizes:
        return
    impl = os.environ.get("DISTSERVE_SAMPLER_IMPL", "radix")  # or "sort": the same sets, by one stable sort
    if impl not in ("radix", "sort"):
        raise ValueError(f"DISTSERVE_SAMPLER_IMPL must be radix or sort, got {impl!r}")
    try:
        engine.sampler = Sampler(GraphSampler(vocab, sizes, engine.device, impl=impl), impl=impl)
    except Exception as e:  # e.g. no memory left for the graphs' workspace: sample eagerly, as before
        log.warning("sampler CUDA graphs not captured (%s: %s); sampling eagerly", type(e).__name__, e)
        if engine.device.type == "cuda":
            torch.cuda.empty_cache()


__all__ = ["CudaGraphRunner", "attach_graph_sampler", "setup_cuda_engine", "capture_sizes"]
