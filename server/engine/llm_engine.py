"""One engine: model + KV pool + scheduler + sampler, stepped by its owner.

The engine is single-threaded and synchronous: a worker process owns one and
calls ``step()`` in a loop (``server/workers``), the CLI and the tests call it
directly. It serves the three roles of disaggregated serving:

- colocated: ``add_request`` then ``step()`` until finished;
- prefill: ``add_request(..., prefill_only=True)``; the sequence stops after
  token #1 with its blocks kept (``FINISHED_PREFILLED``) until the worker has
  copied them out with ``take_prefilled_kv``;
- decode: ``reserve_prefilled`` allocates blocks (``WAITING_FOR_REMOTE_KVS``) while the
  KV is pulled, ``commit_prefilled`` writes it and continues from token #1.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from distserve.server.engine.attention import get_attention_backend
from distserve.server.engine.block_manager import BlockManager
from distserve.server.engine.fp8 import (
    FP8_DTYPE,
    bf16_layer_set,
    check_scales,
    is_fp8,
    quantize_model_weights,
    with_fp8_linears,
)
from distserve.server.engine.fp8 import ROUNDINGS as FP8_ROUNDINGS
from distserve.server.engine.kv_sizing import KVBudget
from distserve.server.engine.loader import load_model_config, load_state_dict, resolve_model_path
from distserve.server.engine.memory_pressure import MemoryPressure, is_memory_error, relieve
from distserve.server.engine.memory_profile import MemoryProbe, SizingInputs, StartupMemory, process_used, size_kv_pool
from distserve.server.engine.model import LlamaForCausalLM
from distserve.server.engine.model_runner import ModelRunner, kv_bytes_per_block
from distserve.server.engine.ops.layer_ops import select_layer_ops
from distserve.server.engine.presets import init_random_weights, is_preset, preset_config
from distserve.server.engine.sampler import Sampler, TokenLogprobs
from distserve.server.engine.sampling_params import SamplingParams
from distserve.server.engine.scheduler import Scheduler, SchedulerConfig
from distserve.server.engine.sequence import Sequence, SequenceStatus
from distserve.server.engine.structured.decoding import StructuredDecoding

log = logging.getLogger(__name__)

# the start-up prefill the worker times (LLMEngine.measure_prefill): prompts of at most this many tokens
WARMUP_PROMPT_TOKENS = 256
WARMUP_DECODE_PROMPT_TOKENS = 16  # the start-up decode timing's prompts (measure_decode)
WARMUP_DECODE_STEPS = 4

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# The decode and sampler CUDA graphs are captured over the profiling cache and measured before the KV
# pool is sized (memory_profile.size_kv_pool); nothing is reserved for them by a constant any more.


def check_fp8_device(device: torch.device, uses_fp8: bool) -> None:
    """FP8 storage needs e4m3 support: CUDA compute capability 8.9+ (Ada, Hopper), or the CPU's emulated
    path (values widened before each op: correct, slower than float32; for tests and accuracy runs)."""
    if not uses_fp8:
        return
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            raise ValueError(
                f"FP8 weights or KV need a GPU of compute capability 8.9 or newer; {device} has {cap[0]}.{cap[1]}"
            )
    elif device.type == "cpu":
        log.warning("FP8 on the CPU runs the emulated path (e4m3 storage, widened per op): slower than float32")
    else:
        raise ValueError(f"FP8 weights or KV are not supported on {device.type}; use cuda or cpu")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # None = the built-in tiny model
    device: str = "cpu"
    dtype: str = "auto"  # auto: float32 on CPU, the checkpoint's dtype on GPU
    block_size: int = 16
    num_blocks: int = 0  # 0 = from kv_cache_memory_mb
    kv_cache_memory_mb: int = 512  # CPU (and CUDA with gpu_memory_utilization 0): KV size when num_blocks is 0
    # CUDA, num_blocks 0: share of the device; KV gets what is left. 0 here (direct engine users, tests that
    # build several engines in one process); the worker passes cache.gpu_memory_utilization (0.9 default)
    gpu_memory_utilization: float = 0.0
    # CUDA sizing (kv_sizing): bytes the owner allocates after the engine (a KV staging pool), tokens of
    # pulled KV in flight (decode receive buffers), and memory to leave free inside the share
    gpu_memory_reserved_bytes: int = 0
    kv_receive_tokens: int = 0  # tokens of KV held outside the pool: gathered (prefill) or received (decode)
    gpu_memory_headroom_bytes: int = 0
    # the device's memory when the process sees less (an MPS client under CUDA_MPS_PINNED_DEVICE_MEM_LIMIT):
    # gpu_memory_utilization is a share of the whole device; 0 = what CUDA reports
    gpu_device_total_bytes: int = 0
    # this process's own ceiling on the device (an MPS client's pinned limit less the CUDA context): the KV
    # pool is sized inside the lower of it and the share; 0 = none
    gpu_process_limit_bytes: int = 0
    # the engine runs decode steps: False for a prefill worker (its sequences stop at token #1), which then
    # captures no decode CUDA graphs and tunes no decode kernels (memory and start-up time it never uses)
    decode_graphs: bool = True
    max_model_len: int = 0  # 0 = the model's max_position_embeddings
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    prefill_policy: str = "fcfs"
    decode_policy: str = "fcfs"
    attention_backend: str = "auto"
    torch_threads: int = 0  # 0 = leave torch's default
    enable_prefix_caching: bool = True  # reuse the KV of full blocks whose whole prefix matches
    enforce_eager: bool = False  # CUDA only: no CUDA graphs for decode steps
    # CUDA, Triton ops, bf16 one-token decode (docs/performance/engine-gpu.md, "Fused one-token decode"): the
    # RMSNorms, residual adds and SiLU x mul inside the tuned Triton GEMVs (three kernels fewer per layer);
    # False: the unfused kernels. No effect elsewhere (CPU, prefill, batches > 1, FP8 weights, cuBLAS GEMVs).
    # Off by default until measured on a GPU (checked so far in Triton's interpreter and by an sm_90 compile only)
    fused_decode_gemv: bool = False
    # FP8 storage (fp8.py, docs/FP8.md): decoder linears in e4m3 with per-channel scales ("bf16" = as
    # loaded, the compute dtype); the KV cache in e4m3 with per-layer scales calibrated online
    weight_dtype: str = "bf16"
    fp8_bf16_layers: str = "none"  # FP8 weights: decoder layers kept in the compute dtype (none | first_last)
    # FP8 weights: nearest (round each weight to its nearest e4m3 value) | gptq (error-compensating rounding
    # from calibration activations at load, fp8_gptq.py: same format and scales, a slower load)
    fp8_weight_rounding: str = "nearest"
    kv_cache_dtype: str = "auto"  # auto | bf16 (= the compute dtype) | fp8_e4m3
    kv_scale_init: float = 1.0
    kv_calibration_requests: int = 1000  # finished requests before the FP8 KV scales are set; 0 = never
    # the KV pool as one allocation a peer process on the same device can map (CUDA IPC, or POSIX shm on
    # the CPU): a decode worker that takes KV by reference (server/kv_transfer/by_reference.py)
    kv_arena: str = "off"  # off | auto (a private pool when it cannot be exported, with a warning) | on

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be auto or one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.weight_dtype not in ("bf16", "fp8"):
            raise ValueError(f"weight_dtype must be bf16 or fp8, got {self.weight_dtype!r}")
        if self.fp8_bf16_layers not in ("none", "first_last"):
            raise ValueError(f"fp8_bf16_layers must be none or first_last, got {self.fp8_bf16_layers!r}")
        if self.fp8_weight_rounding not in FP8_ROUNDINGS:
            raise ValueError(f"fp8_weight_rounding must be nearest or gptq, got {self.fp8_weight_rounding!r}")
        if not isinstance(self.fused_decode_gemv, bool):
            raise ValueError(f"fused_decode_gemv must be true or false, got {self.fused_decode_gemv!r}")
        if self.kv_cache_dtype not in ("auto", "bf16", "fp8_e4m3"):
            raise ValueError(f"kv_cache_dtype must be auto, bf16 or fp8_e4m3, got {self.kv_cache_dtype!r}")


@dataclass
class EngineStats:
    num_steps: int = 0
    num_preemptions: int = 0
    num_prompt_tokens: int = 0  # tokens computed in prefill chunks (recompute included)
    num_generated_tokens: int = 0


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    error: str | None = None  # set with finish_reason "abort" when the engine failed this request
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache (None: not known here)
    # per new token when the request asked for logprobs: (its logprob, [(id, logprob)] of the k most likely)
    logprobs: list[TokenLogprobs] | None = None


class LLMEngine:
    def __init__(self, config: EngineConfig = EngineConfig(), memory_probe: MemoryProbe | None = None) -> None:
        """``memory_probe``: the device queries of the KV sizing (``torch.cuda`` on a GPU by default; tests
        pass a fake one to size a CPU engine's pool from given numbers)."""
        self.config = config
        self.memory_pressure = MemoryPressure()  # steps that failed for lack of device memory
        if config.torch_threads > 0:
            torch.set_num_threads(config.torch_threads)
        self.model_path: Path | None = None  # None: "preset:NAME", random weights made on the device, no files
        if is_preset(config.model):
            self.model_config = preset_config(config.model)
        else:
            self.model_path = resolve_model_path(config.model)
            self.model_config = load_model_config(self.model_path)
        self.device = torch.device(config.device)
        self.dtype = self._resolve_dtype()
        self.kv_dtype = FP8_DTYPE if config.kv_cache_dtype == "fp8_e4m3" else self.dtype
        uses_fp8 = config.weight_dtype == "fp8" or is_fp8(self.kv_dtype)
        check_fp8_device(self.device, uses_fp8)
        backend_name = config.attention_backend
        if is_fp8(self.kv_dtype) and backend_name == "auto" and self.device.type == "cpu":
            backend_name = "sdpa"  # the C++ paged kernel reads float32 caches only
        backend = get_attention_backend(backend_name, self.device)
        if is_fp8(self.kv_dtype) and not getattr(backend, "supports_fp8_kv", False):
            raise ValueError(f"attention backend {backend.name!r} cannot read an FP8 KV cache; use sdpa or triton")
        # device memory free before this engine allocates anything (for kv_sizing: what this
        # process adds outside torch's allocator, as opposed to other processes' memory)
        if memory_probe is None and self.device.type == "cuda":
            memory_probe = MemoryProbe(self.device)
        self._probe = memory_probe
        self._free_at_start = memory_probe.mem_info()[0] if memory_probe is not None else 0
        self._tuned: set[str] = set()  # start-up kernel tunings done (cuda_graph_runner.setup_cuda_engine)
        # fused Triton ops on a GPU
        ops = select_layer_ops(backend, self.device, self.model_config.head_dim, config.fused_decode_gemv)
        if config.weight_dtype == "fp8":
            ops = with_fp8_linears(ops)
        with torch.device("meta"):
            model = LlamaForCausalLM(self.model_config, backend, ops)
        # Module.to_empty, but with torch.empty: its empty_like of a meta tensor goes through torch._refs, whose
        # first call imports sympy (0.5 s of CPU in every worker's start-up)
        model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=self.device)).to(self.dtype)
        if self.model_path is None:
            init_random_weights(model)
        else:
            model.load_hf_weights(load_state_dict(self.model_path, dtype=self.dtype, device=str(self.device)))
        self.weight_report: dict | None = None
        if config.weight_dtype == "fp8":
            keep = bf16_layer_set(config.fp8_bf16_layers, self.model_config.num_hidden_layers)
            calibration = None
            if config.fp8_weight_rounding == "gptq":
                from distserve.server.engine.fp8_gptq import SEQ_LEN, calibration_sequences

                tok = self._load_tokenizer()
                calibration = calibration_sequences(
                    lambda text: tok.encode(text, add_bos=False),
                    seq_len=min(SEQ_LEN, self.model_config.max_position_embeddings),
                    vocab_size=self.model_config.vocab_size,
                )
            self.weight_report = quantize_model_weights(model, keep, config.fp8_weight_rounding, calibration)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # GPTQ's Hessians and activations: not the KV pool's to lose
            log.info("FP8 weights: %s", self.weight_report)
        self.model = model.eval().requires_grad_(False)
        weights = memory_probe.allocated() if memory_probe is not None else 0
        eos = sorted(self.model_config.eos_token_ids)
        self.structured = StructuredDecoding(self._load_tokenizer, self.model_config.vocab_size, eos)
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        window = self.model_config.sliding_window
        if window is not None and window < self.max_model_len:
            log.warning(
                "model uses sliding-window attention (window %d); max_seq_len capped from %d to %d "
                "so full attention stays exact",
                window,
                self.max_model_len,
                window,
            )
            self.max_model_len = window
        self._cap_max_model_len_for_rope()
        # before the KV profile: its profiling prefill steps (and samples) like any request
        self.sampler = Sampler()
        self.kv_budget: KVBudget | None = None
        self.startup_memory: StartupMemory | None = None
        if not config.num_blocks and memory_probe is not None and config.gpu_memory_utilization > 0:
            self.kv_budget, self.startup_memory = self._profile_kv_blocks(memory_probe, weights)
            log.info("%s", self.kv_budget.describe())
            num_blocks = self.kv_budget.num_blocks
        else:
            num_blocks = config.num_blocks or max(
                1,
                config.kv_cache_memory_mb
                * 2**20
                // kv_bytes_per_block(self.model_config, config.block_size, self.kv_dtype),
            )
        self.kv_arena: Any = None  # kv_arena.ArenaOwner when the pool is exported (config.kv_arena)
        self._build_cache(num_blocks, arena=config.kv_arena != "off")
        self.stats = EngineStats()
        self.requests: dict[str, Sequence] = {}
        self.awaiting_kv: dict[str, Sequence] = {}  # WAITING_FOR_REMOTE_KVS, oldest reservation first
        self._seeds: dict[str, int] = {}
        self._rng = random.Random()
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        self.cuda_graph_bytes = 0  # measured: what kernel tuning and graph capture kept (in and outside torch)
        if self.device.type == "cuda":  # kernel tuning + decode and sampler CUDA graphs, over the real pool
            from distserve.server.engine.cuda_graph_runner import setup_cuda_engine

            probe = self._probe if self._probe is not None else MemoryProbe(self.device)
            probe.synchronize()
            before = process_used(probe, self._free_at_start)
            setup_cuda_engine(self, phase="final")
            probe.synchronize()
            probe.empty_cache()  # the tuners' scratch tensors
            self.cuda_graph_bytes = max(0, process_used(probe, self._free_at_start) - before)
        if self.startup_memory is not None:
            self.startup_memory.startup_final = self.cuda_graph_bytes
            log.info("%s", self.startup_memory.describe(self.kv_budget))

    def _build_cache(self, num_blocks: int, arena: bool = False) -> None:
        config = self.config
        storage = None
        if arena and not is_fp8(self.kv_dtype):  # FP8 caches are not shared: each worker has its own scales
            from distserve.server.kv_transfer.kv_arena import ArenaError, ArenaOwner, layout_for

            try:
                self.kv_arena = ArenaOwner(
                    layout_for(self.model_config, num_blocks, config.block_size, self.kv_dtype), self.device
                )
                storage = self.kv_arena.tensor
            except ArenaError as e:
                if config.kv_arena == "on":
                    raise
                log.warning("KV pool not exported (%s): KV arrives by copy only", e)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                prefill_policy=config.prefill_policy,
                decode_policy=config.decode_policy,
            ),
            self.block_manager,
        )
        self.runner = ModelRunner(
            self.model,
            num_blocks,
            config.block_size,
            self.dtype,
            self.device,
            kv_dtype=self.kv_dtype,
            kv_scale_init=config.kv_scale_init,
            kv_calibration_requests=config.kv_calibration_requests,
            kv_storage=storage,
        )

    @property
    def kv_cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.runner.kv_caches)

    def _profile_kv_blocks(self, probe: MemoryProbe, weights: int) -> tuple[KVBudget, StartupMemory]:
        """Size the KV pool from measured memory (memory_profile.size_kv_pool, in vLLM's order): one
        prefill of the largest batch the scheduler forms (max_num_batched_tokens, capped by
        max_model_len) on a cache just big enough for it (torch's peak), then the start-up set-up (kernel
        tuning that needs no pool, decode and sampler CUDA graphs) over that cache, measured and
        released; the pool gets what ``gpu_memory_utilization`` (or the process limit) leaves."""
        config = self.config
        bs = config.block_size
        n_tokens = max(1, min(config.max_num_batched_tokens, self.max_model_len - 1))
        block_bytes = kv_bytes_per_block(self.model_config, bs, self.kv_dtype)

        def profile() -> int:
            self._build_cache(-(-(n_tokens + 1) // bs) + 1)
            self.stats = EngineStats()
            self.requests, self._seeds, self._rng = {}, {}, random.Random()
            self.awaiting_kv = {}
            self.eos_token_ids = set()
            self.add_request("kv-profile", [1] * n_tokens, SamplingParams(max_tokens=1, ignore_eos=True))
            while self.has_unfinished_requests():
                self.step()
            return self.kv_cache_bytes

        def setup() -> None:
            if self.device.type == "cuda":
                from distserve.server.engine.cuda_graph_runner import setup_cuda_engine

                setup_cuda_engine(self, phase="measure")

        def teardown() -> None:  # the graphs point into the profiling cache: captured again over the pool
            self.runner.graph_runner = None
            self.sampler = Sampler()
            gc.collect()

        def drop_cache() -> None:
            del self.runner, self.block_manager, self.scheduler
            gc.collect()

        inputs = SizingInputs(
            utilization=config.gpu_memory_utilization,
            block_bytes=block_bytes,
            min_blocks=-(-self.max_model_len // bs),
            profile_tokens=n_tokens,
            device_total=config.gpu_device_total_bytes,
            process_limit=config.gpu_process_limit_bytes,
            reserved=config.gpu_memory_reserved_bytes + config.kv_receive_tokens * block_bytes // bs,
            headroom=config.gpu_memory_headroom_bytes,
        )
        return size_kv_pool(probe, inputs, self._free_at_start, weights, profile, setup, teardown, drop_cache)

    def measure_prefill(self, total_tokens: int) -> dict | None:
        """Time one prefill batch of about ``total_tokens`` prompt tokens (prompts of at most
        ``WARMUP_PROMPT_TOKENS`` each, within the scheduler's budgets) on this engine, after an untimed
        short prefill that pays the first call's one-off costs. Returns ``{"tokens", "requests", "ms"}``:
        the worker reports it at registration and the router's TTFT model uses its cost per token until it
        has measured real calls (server/router/ttft_predictor.py). None when there is nothing to measure
        (``total_tokens`` 0) or measuring would change what requests see (FP8 KV scales still calibrating on
        the first requests). Leaves no request, cached prefix or step count behind."""
        if total_tokens <= 0 or self.runner.kv_calibration is not None or self.requests:
            return None
        cfg = self.config
        budget = max(1, min(total_tokens, cfg.max_num_batched_tokens))
        bm = self.block_manager
        # within the KV pool too: a prompt and its first token in the free blocks, as many prompts as fit at once
        prompt = min(WARMUP_PROMPT_TOKENS, self.max_model_len - 1, budget, (bm.num_free_blocks - 1) * bm.block_size - 1)
        if prompt < 1:
            return None
        n = max(1, min(cfg.max_num_seqs, budget // prompt, bm.num_free_blocks // -(-(prompt + 1) // bm.block_size)))
        vocab = max(2, self.model_config.vocab_size)
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        with self._warmup_scope("warmup-"):
            self.add_request("warmup-0", [1 + i % (vocab - 1) for i in range(min(16, prompt))], params)
            while self.has_unfinished_requests():
                self.step()
            for r in range(n):  # distinct prompts
                tokens = [1 + (r * 7919 + i * 31) % (vocab - 1) for i in range(prompt)]
                self.add_request(f"warmup-{r + 1}", tokens, params)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            t0 = time.perf_counter()
            failed = False
            while self.has_unfinished_requests():
                failed |= any(o.error is not None for o in self.step())
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            ms = (time.perf_counter() - t0) * 1000.0
        if failed:  # a prompt the engine failed (it would be a timing of nothing): no prior rather than a wrong one
            return None
        return {"tokens": n * prompt, "requests": n, "ms": round(ms, 3)}

    def measure_decode(self, batch: int, steps: int = WARMUP_DECODE_STEPS) -> dict | None:
        """Time ``steps`` decode steps of one short sequence, then of a batch of ``batch`` (at most
        ``max_num_seqs``, within the KV pool), each after its prefill step and one decode step (untimed).
        Returns ``{"batch", "steps", "ms", "ms_batch1"}``, ms per step: the worker reports it at registration
        and the router's decode-room prior reads the step at the batch decoding now off the line through the
        two points as the time per output token before any stream has decoded
        (server/router/ttft_predictor.py ``RoomPrior``). None when there is nothing to measure (``batch``
        0), measuring would change what requests see (FP8 KV scales still calibrating), or a sequence
        failed. Leaves no request, cached prefix or step count behind."""
        if batch <= 0 or steps <= 0 or self.runner.kv_calibration is not None or self.requests:
            return None
        bm = self.block_manager
        prompt = min(WARMUP_DECODE_PROMPT_TOKENS, self.max_model_len - steps - 2)
        per_seq = -(-(prompt + steps + 2) // bm.block_size)
        n = min(batch, self.config.max_num_seqs, bm.num_free_blocks // max(1, per_seq))
        if prompt < 1 or n < 1:
            return None
        one = self._time_decode_steps(1, prompt, steps)
        many = one if n == 1 or one is None else self._time_decode_steps(n, prompt, steps)
        if one is None or many is None:
            return None
        return {"batch": n, "steps": steps, "ms": round(many, 3), "ms_batch1": round(one, 3)}

    def _time_decode_steps(self, n: int, prompt: int, steps: int) -> float | None:
        """ms per decode step of ``n`` sequences of ``prompt`` dummy tokens (``measure_decode``)."""
        vocab = max(2, self.model_config.vocab_size)
        params = SamplingParams(max_tokens=steps + 2, ignore_eos=True)
        failed, done, ms = False, 0, 0.0
        with self._warmup_scope("warmup-d"):
            for r in range(n):
                self.add_request(f"warmup-d{r}", [1 + (r * 7919 + i * 31) % (vocab - 1) for i in range(prompt)], params)
            for _ in range(2):  # the prefill step, then one decode step that pays one-off costs
                failed |= any(o.error is not None for o in self.step())
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            t0 = time.perf_counter()
            while done < steps and self.has_unfinished_requests():
                failed |= any(o.error is not None for o in self.step())
                done += 1
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            ms = (time.perf_counter() - t0) * 1000.0
        return None if failed or done < steps else ms / steps

    @contextlib.contextmanager
    def _warmup_scope(self, prefix: str) -> Iterator[None]:
        """A start-up timing's dummy requests (ids starting with ``prefix``) stay out of the prefix cache and
        leave nothing behind: aborted if still there, the engine stepped empty, its counters reset."""
        bm = self.block_manager
        caching, bm.enable_prefix_caching = bm.enable_prefix_caching, False
        try:
            yield
        finally:
            bm.enable_prefix_caching = caching
            for rid in [r for r in self.requests if r.startswith(prefix)]:
                self.abort_request(rid)
            while self.has_unfinished_requests():
                self.step()
            self.stats = EngineStats()

    def _load_tokenizer(self):
        """The model's tokenizer (for grammars; loaded on the first constrained request)."""
        from distserve.server.engine.loader import load_tokenizer
        from distserve.server.engine.tokenizer import Tokenizer

        return Tokenizer.byte_tokenizer() if self.model_path is None else load_tokenizer(self.model_path)

    def _cap_max_model_len_for_rope(self) -> None:
        """Dynamic NTK RoPE equals plain RoPE up to max_position_embeddings; past it transformers re-derives
        the frequencies from the batch's length, which a KV cache cannot follow: cap there, as for a window."""
        mc = self.model_config
        if mc.rope_scaling.rope_type == "dynamic" and self.max_model_len > mc.max_position_embeddings:
            log.warning(
                "model uses dynamic NTK RoPE; max_seq_len capped from %d to max_position_embeddings %d "
                "so the rotary math stays exact",
                self.max_model_len,
                mc.max_position_embeddings,
            )
            self.max_model_len = mc.max_position_embeddings

    def _resolve_dtype(self) -> torch.dtype:
        if self.config.dtype != "auto":
            return _DTYPES[self.config.dtype]
        if self.device.type == "cpu":
            return torch.float32
        return _DTYPES.get(self.model_config.torch_dtype, torch.bfloat16)

    # --- requests ----------------------------------------------------------
    def _check_new(self, request_id: str, prompt_token_ids: list[int], num_outputs: int = 0) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in this engine")
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        if len(prompt_token_ids) + num_outputs >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_token_ids) + num_outputs} tokens; max_seq_len is {self.max_model_len} "
                f"(prompt + at least one generated token must fit)"
            )
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")

    def _check_params(self, params: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        bad = [t for t, _ in params.logit_bias if t >= vocab]
        if bad:
            raise ValueError(f"logit_bias: token id {bad[0]} is outside the vocabulary [0, {vocab})")

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prefill_only: bool = False,
        output_token_ids: list[int] | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request. ``output_token_ids`` resumes a request that already produced
        tokens elsewhere (migration, or a KV transfer that failed under policy ``recompute``):
        they are prefilled with the prompt and generation continues after them. ``arrival_time``
        (``time.monotonic()``, default now) is when the request reached the caller: the ``wfs``
        prefill order ages prompts from it."""
        outputs = list(output_token_ids or [])
        self._check_new(request_id, prompt_token_ids, len(outputs))
        self._check_params(params)
        seq = Sequence(request_id, list(prompt_token_ids), params, prefill_only=prefill_only, output_token_ids=outputs)
        if arrival_time is not None:
            seq.arrival_time = min(arrival_time, seq.arrival_time)
        self.structured.add(seq)  # its grammar's matcher, replaying `outputs` (GrammarError is a ValueError)
        self._register(seq)
        self.scheduler.add(seq)

    # --- decode side of a KV transfer: reserve blocks, then commit the pulled KV ---
    def reserve_prefilled(
        self, request_id: str, prompt_token_ids: list[int], output_token_ids: list[int], params: SamplingParams
    ) -> bool:
        """Allocate blocks for a request whose KV will arrive from a prefill worker.

        The KV covers every token but the newest (``len(prompt) + len(outputs) - 1``).
        Returns False, changing nothing, when the pool cannot take it now: the caller
        retries later (back-pressure). A reserved request is not scheduled until
        ``commit_prefilled``; ``abort_request`` releases it like any other.
        """
        if not output_token_ids:
            raise ValueError("a prefilled request needs its first generated token")
        self._check_new(request_id, prompt_token_ids, len(output_token_ids))
        self._check_params(params)
        seq = Sequence(request_id, list(prompt_token_ids), params, output_token_ids=list(output_token_ids))
        if not self.block_manager.can_grow(seq, seq.num_tokens) or (
            self.scheduler.num_running >= self.config.max_num_seqs
        ):
            return False
        self.structured.add(seq)  # replays token #1 (and any tokens from before a migration)
        self.block_manager.grow(seq, seq.num_tokens)
        seq.status = SequenceStatus.WAITING_FOR_REMOTE_KVS
        self._register(seq)
        self.awaiting_kv[request_id] = seq
        return True

    def commit_prefilled(self, request_id: str, kv: torch.Tensor, kv_scales: list[list[float]] | None = None) -> None:
        """Write the pulled KV into the reserved blocks; FP8 KV comes with its per-layer [K, V] scales and is
        re-quantised to this engine's scales if they differ; KV in a compute dtype going into an FP8 cache is
        quantised here, once (``ModelRunner.scatter_kv``)."""
        seq = self.awaiting_kv.get(request_id)
        if seq is None:
            raise KeyError(f"request {request_id!r} has no reservation")
        expected = self.runner.kv_shape(seq.num_tokens - 1)
        if tuple(kv.shape) != expected:
            raise ValueError(f"KV for {request_id!r} has shape {tuple(kv.shape)}, expected {expected}")
        if kv_scales is not None:
            kv_scales = check_scales(kv_scales, self.model_config.num_hidden_layers)
        self.runner.scatter_kv(seq.block_table, kv, kv_scales)
        seq.num_computed_tokens = seq.num_tokens - 1
        del self.awaiting_kv[request_id]
        self.scheduler.add_running(seq)

    def adopt_prefilled(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        params: SamplingParams,
        block_ids: list[int],
    ) -> bool:
        """Take a request whose KV a peer wrote into ``block_ids`` of this engine's pool (leased with
        ``block_manager.take_blocks``: KV by reference); they become its block table, nothing is copied.
        The blocks cover the KV (every token but the newest) and the newest token's slot. False, changing
        nothing, when ``max_num_seqs`` are running (the caller retries); ValueError for a request that
        does not fit its blocks."""
        if not output_token_ids:
            raise ValueError("a prefilled request needs its first generated token")
        self._check_new(request_id, prompt_token_ids, len(output_token_ids))
        self._check_params(params)
        seq = Sequence(request_id, list(prompt_token_ids), params, output_token_ids=list(output_token_ids))
        if self.block_manager.blocks_needed(seq.num_tokens) != len(block_ids):
            raise ValueError(f"{len(block_ids)} KV blocks for {seq.num_tokens} tokens of {request_id!r}")
        if self.scheduler.num_running >= self.config.max_num_seqs:
            return False
        self.structured.add(seq)
        self.block_manager.adopt(seq, block_ids)
        seq.num_computed_tokens = seq.num_tokens - 1
        self._register(seq)
        self.scheduler.add_running(seq)
        return True

    def _register(self, seq: Sequence) -> None:
        self.requests[seq.request_id] = seq
        seed = seq.sampling_params.seed
        self._seeds[seq.request_id] = seed if seed is not None else self._rng.getrandbits(62)

    def abort_request(self, request_id: str) -> bool:
        seq = self.requests.get(request_id)
        if seq is None:
            return False
        self.scheduler.remove(seq)
        seq.status = SequenceStatus.FINISHED_ABORTED
        self._release(seq)
        return True

    def _release(self, seq: Sequence) -> None:
        if seq.block_table:
            self.block_manager.free(seq)
        self.requests.pop(seq.request_id, None)
        self.awaiting_kv.pop(seq.request_id, None)
        self._seeds.pop(seq.request_id, None)
        self.structured.remove(seq.request_id)

    def take_prefilled_kv(self, request_id: str) -> tuple[Sequence, torch.Tensor]:
        """KV of a FINISHED_PREFILLED sequence (every token but the newest) as one
        contiguous tensor; frees its blocks."""
        seq = self.requests.get(request_id)
        if seq is None or seq.status != SequenceStatus.FINISHED_PREFILLED:
            raise KeyError(f"request {request_id!r} is not a finished prefill")
        kv = self.runner.gather_kv(seq.block_table, seq.num_tokens - 1)
        self._release(seq)
        return seq, kv

    # --- stepping ----------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        outputs: list[RequestOutput] = []
        for seq in sched.rejected:
            blocks = -(-seq.num_tokens // self.block_manager.block_size)
            outputs.append(
                self._fail(
                    seq, f"request needs {blocks} KV blocks; this worker's KV pool has {self.block_manager.num_blocks}"
                )
            )
        if sched.is_empty:
            return outputs
        self.stats.num_steps += 1
        self.stats.num_preemptions += len(sched.preempted)
        self.stats.num_prompt_tokens += sum(s.num_new_tokens for s in sched.scheduled if s.num_new_tokens > 1)
        scheduled = sched.scheduled
        try:
            logits = self.runner.execute(scheduled)
        except Exception as e:  # find whose input breaks the forward; the others go on
            if is_memory_error(e):  # free the allocator's cache first: alone, each may fit
                self.memory_pressure.record()
                relieve(self.device)
            scheduled, logits = self._execute_isolating(scheduled, e, outputs)
        sampling = [s.seq for s in scheduled if s.samples]
        self.structured.mask_logits(logits, sampling)  # grammar masks of constrained rows, before sampling
        tokens: list[int | str] = []
        logprobs: list[TokenLogprobs | None] = []
        if sampling:
            try:
                params = [s.sampling_params for s in sampling]
                sampled = self.sampler.sample(
                    logits,
                    params,
                    [self._seeds[s.request_id] for s in sampling],
                    [s.num_output_tokens for s in sampling],
                    # the penalties' counts are rebuilt from the ids each step: a request resumed elsewhere
                    # (hand-off, migration, recompute) with its outputs sees the same logits
                    sampling if any(p.has_penalties for p in params) else None,
                )
                tokens, logprobs = sampled.tokens, sampled.logprobs
            except Exception as e:
                if not is_memory_error(e):
                    raise
                # out of memory while sampling: this step's sampled requests fail, nothing else
                self.memory_pressure.record()
                relieve(self.device)
                for seq in sampling:
                    self.scheduler.remove(seq)
                    outputs.append(self._fail(seq, f"out of device memory while sampling: {e}"))
                scheduled = [s for s in scheduled if not s.samples]
                sampling, tokens, logprobs = [], [], []
        bm = self.block_manager
        finished = 0
        for s in scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
            bm.register(s.seq)
        for seq, token, lp in zip(sampling, tokens, logprobs):
            if isinstance(token, str):  # this row could not be sampled: fail its request alone
                self.scheduler.remove(seq)
                outputs.append(self._fail(seq, token))
                continue
            grammar_done = self.structured.accept(seq, token)
            if isinstance(grammar_done, str):  # the token breaks the request's grammar
                self.scheduler.remove(seq)
                outputs.append(self._fail(seq, grammar_done))
                continue
            self.stats.num_generated_tokens += 1
            seq.output_token_ids.append(token)
            self._check_stop(seq, token)
            if grammar_done and (not seq.is_finished or seq.status == SequenceStatus.FINISHED_PREFILLED):
                seq.status = SequenceStatus.FINISHED_STOPPED  # the grammar is complete: nothing may follow
            if seq.is_finished:
                finished += 1
                self.scheduler.remove(seq)
                if seq.status != SequenceStatus.FINISHED_PREFILLED:
                    self._release(seq)
            outputs.append(self._output(seq, [token], None if lp is None else [lp]))
        cal = self.runner.kv_calibration
        if finished and cal is not None:
            cal.on_finished(finished, self.runner.kv_caches)  # at the target: set the scales, re-quantise once
        return outputs

    def kv_calibration_report(self) -> dict | None:
        """FP8 KV cache: calibration state, per-layer scales and amax (a device sync); None otherwise."""
        cal = self.runner.kv_calibration
        if cal is None:
            return None
        cal.refresh_host()
        return cal.report()

    def _execute_isolating(self, scheduled: list, error: Exception, outputs: list[RequestOutput]):
        """The batch forward raised: run each entry alone, fail the ones that still raise (with the
        error they raise), and return (the entries that ran, their logits rows) so the step goes on
        for them. Re-running writes the same KV slots again, so it is safe to repeat."""
        log.warning(
            "engine step of %d sequences failed (%s: %s); retrying them one by one",
            len(scheduled),
            type(error).__name__,
            error,
        )
        kept, rows = [], []
        for s in scheduled:
            try:
                logits = self.runner.execute([s]) if len(scheduled) > 1 else None
                if logits is None:
                    raise error
            except Exception as e:
                if is_memory_error(e):
                    self.memory_pressure.record()
                    relieve(self.device)
                log.warning("request %s fails the model forward: %s: %s", s.seq.request_id, type(e).__name__, e)
                self.scheduler.remove(s.seq)
                outputs.append(self._fail(s.seq, f"the model forward failed on this request: {type(e).__name__}: {e}"))
                continue
            kept.append(s)
            if s.samples:
                rows.append(logits)
        if not rows:
            return kept, None
        return kept, torch.cat(rows)

    def _fail(self, seq: Sequence, reason: str) -> RequestOutput:
        """Abort ``seq`` because of itself, naming the cause; the caller has unscheduled it."""
        log.warning("request %s failed: %s", seq.request_id, reason)
        seq.status = SequenceStatus.FINISHED_ABORTED
        seq.error = reason
        self._release(seq)
        return self._output(seq, [])

    def _check_stop(self, seq: Sequence, token: int) -> None:
        p = seq.sampling_params
        if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
            seq.status = SequenceStatus.FINISHED_STOPPED
            seq.stop_reason = token
        elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.status = SequenceStatus.FINISHED_LENGTH
        elif seq.prefill_only:
            seq.status = SequenceStatus.FINISHED_PREFILLED

    @staticmethod
    def _output(seq: Sequence, new_tokens: list[int], logprobs: list[TokenLogprobs] | None = None) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new_tokens,
            finished=seq.is_finished,
            finish_reason=seq.status.finish_reason,
            num_prompt_tokens=len(seq.prompt_token_ids),
            num_output_tokens=seq.num_output_tokens,
            error=seq.error,
            num_cached_tokens=seq.num_cached_tokens,
            logprobs=logprobs,
        )

    # --- convenience -------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Run prompts to completion together (continuous batching); generated ids per prompt."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{i}-{self._rng.getrandbits(32):08x}" for i in range(len(prompts))]
        result: dict[str, list[int]] = {i: [] for i in ids}
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, p)
        pending = set(ids)
        while pending:
            for out in self.step():
                if out.request_id in result:
                    result[out.request_id].extend(out.new_token_ids)
                    if out.finished:
                        pending.discard(out.request_id)
        return [result[i] for i in ids]

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.block_manager.num_used_blocks
