"""The sampler's draw as CUDA graphs: one per (batch size, filters in use), over static buffers.

Eagerly, a sampled step launches ~40-80 small kernels after the model's graph, plus the host-to-device
copies of the per-row parameters; at batch 64 on an H200 that is about as long as the GPU work itself.
``GraphSampler`` captures ``sampler.sample_rows`` once per captured batch size and per ``Filters``
combination (top_k on/off x top_p on/off; min_p is always in, it costs three kernels) over static
buffers:

- ``logits`` ``[max_bs, vocab]`` float32: the step's logits are copied in (``load``), and logit_bias and
  the penalties, when a row has them, are applied there in place (eagerly), so the caller's logits stay
  raw for the logprobs;
- ``fparams`` ``[max_bs, 4]`` float32 and ``iparams`` ``[max_bs, 3]`` int64 (``sample_rows``' two
  parameter tables: temperature, top_p, min_p, greedy; seed, output index, top_k), written from one
  pinned host buffer each per step (two non-blocking copies);
- the output ids of each graph.

A step of ``n`` rows replays the graph of the next captured size ``bs >= n``; rows ``n..bs`` hold
whatever the last step left (every op is row-wise: they cannot change another row) and are dropped. The
random numbers come from the same counter-based hash of (seed, output index) as the eager sampler, read
from ``iparams`` inside the graph, so a request's tokens are the same in and out of the graph.

Off the GPU (tests) ``use_graphs=False`` runs the same static-buffer function eagerly. Sizes whose
``bs x vocab`` exceeds ``max_elements`` are not captured (their workspace would cost more memory than
the launches they save); such steps sample eagerly, as does every step when the capture failed
(``cuda_graph_runner.attach_graph_sampler`` then keeps the eager sampler and logs why).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from distserve.server.engine.sampler import Filters, sample_rows

log = logging.getLogger(__name__)

VARIANTS = tuple(Filters(k, p) for k in (False, True) for p in (False, True))  # top_k x top_p
MAX_ELEMENTS = 1 << 22  # bs x vocab of the largest graph (~0.25 GB of workspace at that size, shared)


class GraphSampler:
    def __init__(
        self,
        vocab: int,
        batch_sizes: list[int],
        device: torch.device,
        use_graphs: bool | None = None,
        max_elements: int = MAX_ELEMENTS,
        impl: str = "radix",
    ) -> None:
        sizes = sorted({b for b in batch_sizes if b * vocab <= max_elements})
        if not sizes:
            raise ValueError(f"no batch size of {sorted(batch_sizes)} fits {max_elements} elements at vocab {vocab}")
        self.batch_sizes, self.max_bs, self.vocab, self.device = sizes, sizes[-1], vocab, device
        self.use_graphs = (device.type == "cuda") if use_graphs is None else use_graphs
        self.impl = impl  # sampler.Filters.impl of every graph (radix or sort)
        b = self.max_bs
        self.logits = torch.zeros(b, vocab, dtype=torch.float32, device=device)
        self.fparams = torch.zeros(b, 4, dtype=torch.float32, device=device)
        self.iparams = torch.zeros(b, 3, dtype=torch.int64, device=device)
        self.fparams[:, 0] = 1.0
        self.iparams[:, 2] = vocab
        pin = device.type == "cuda"
        self._fhost = torch.zeros(b, 4, dtype=torch.float32, pin_memory=pin)
        self._ihost = torch.zeros(b, 3, dtype=torch.int64, pin_memory=pin)
        self._fnp, self._inp = self._fhost.numpy(), self._ihost.numpy()
        self._copy_done = torch.cuda.Event() if pin else None
        self.graphs: dict[tuple[int, Filters], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, Filters], torch.Tensor] = {}
        self.num_replays = 0
        self.capture()

    def _run(self, bs: int, filters: Filters) -> torch.Tensor:
        return sample_rows(self.logits[:bs], self.fparams[:bs], self.iparams[:bs], filters)

    @torch.inference_mode()
    def capture(self) -> None:
        if not self.use_graphs:
            return
        pool = None
        stream = torch.cuda.Stream(device=self.device)
        for bs in sorted(self.batch_sizes, reverse=True):
            for variant in VARIANTS:
                filters = variant.graphed(self.impl)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    self._run(bs, filters)  # warm-up
                torch.cuda.current_stream(self.device).wait_stream(stream)
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    out = self._run(bs, filters)
                pool = graph.pool()
                self.graphs[(bs, filters)] = graph
                self.outputs[(bs, filters)] = out
        torch.cuda.synchronize(self.device)
        log.info("captured sampler CUDA graphs for batch sizes %s", self.batch_sizes)

    def padded_size(self, n: int) -> int | None:
        for bs in self.batch_sizes:
            if bs >= n:
                return bs
        return None

    def fits(self, n: int, vocab: int, device: torch.device) -> bool:
        return vocab == self.vocab and device == self.logits.device and 0 < n <= self.max_bs

    def load(self, logits: torch.Tensor) -> torch.Tensor:
        """Copy a step's logits into the static input; returns the rows' view (to process in place)."""
        n = logits.shape[0]
        x = self.logits[:n]
        x.copy_(logits)
        return x

    @torch.inference_mode()
    def replay(self, n: int, fl: list[list[float]], il: list[list[int]], filters: Filters) -> torch.Tensor:
        """Ids ``[n]`` (int64, on the device) of the rows loaded by ``load``; ``fl``/``il``: ``row_params``."""
        bs = self.padded_size(n)
        if bs is None:
            raise ValueError(f"{n} rows exceed the sampler graphs' largest batch {self.max_bs}")
        filters = filters.graphed(self.impl)  # the captured variant
        if self._copy_done is not None:
            self._copy_done.synchronize()  # the previous step's copy has left the pinned buffers
        self._fnp[:n] = np.asarray(fl, dtype=np.float32)
        self._inp[:n] = np.asarray(il, dtype=np.int64)
        self.fparams[:n].copy_(self._fhost[:n], non_blocking=True)
        self.iparams[:n].copy_(self._ihost[:n], non_blocking=True)
        if self._copy_done is not None:
            self._copy_done.record()
        self.num_replays += 1
        if self.use_graphs:
            self.graphs[(bs, filters)].replay()
            return self.outputs[(bs, filters)][:n]
        return self._run(bs, filters)[:n]


__all__ = ["GraphSampler", "MAX_ELEMENTS", "VARIANTS"]
