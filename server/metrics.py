"""Prometheus metrics of the router and the workers, each in its own registry.

Names and semantics follow vLLM's (``vllm:time_to_first_token_seconds`` etc.),
with the ``distserve_`` prefix, so dashboards carry over. No module-level
registry: every app instance owns one, which keeps tests and multiple apps in
one process independent.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.25,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)
TPOT_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram(
            "distserve_time_to_first_token_seconds",
            "Time to first token (router view).",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "distserve_time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "distserve_inter_token_latency_seconds",
            "Time between streamed token batches.",
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "distserve_e2e_request_latency_seconds", "End-to-end request latency.", buckets=LATENCY_BUCKETS, registry=r
        )
        self.kv_transfer_seconds = Histogram(
            "distserve_kv_transfer_seconds",
            "KV pull time reported by decode workers.",
            ["transport"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.requests = Counter("distserve_requests", "Finished requests by status.", ["status"], registry=r)
        self.prompt_tokens = Counter("distserve_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("distserve_generation_tokens", "Generated tokens.", registry=r)
        self.migrations = Counter("distserve_migrations", "Requests moved to another worker mid-stream.", registry=r)
        self.kv_transfer_bytes = Counter(
            "distserve_kv_transfer_bytes", "KV bytes moved prefill → decode.", ["transport"], registry=r
        )
        self.running = Gauge("distserve_num_requests_running", "Requests in flight at the router.", registry=r)
        self.workers = Gauge(
            "distserve_workers",
            "Registered workers by state (healthy ... dead, draining).",
            ["role", "health"],
            registry=r,
        )
        self.worker_restarts = Gauge(
            "distserve_worker_restarts", "Times the launcher restarted this worker.", ["worker_id", "role"], registry=r
        )
        self.worker_ejections = Counter(
            "distserve_worker_ejections", "Latency-outlier ejections (router/outlier.py).", ["role"], registry=r
        )
        self.workers_ejected = Gauge(
            "distserve_workers_ejected", "Workers out of rotation as latency outliers now.", ["role"], registry=r
        )
        self.prefill_path = Counter(
            "distserve_prefill_path",
            "Requests by where their prompt was prefilled: disaggregated (a prefill worker) or local.",
            ["path"],
            registry=r,
        )
        self.prefix_picks = Counter(
            "distserve_prefix_aware_picks",
            "Prefill/colocated picks by whether the chosen worker's prefix summary held part of the prompt.",
            ["outcome"],
            registry=r,
        )


class WorkerMetrics:
    def __init__(self, role: str) -> None:
        r = self.registry = CollectorRegistry()
        self.role = role
        self.queue_depth = Gauge("distserve_queue_depth", "Requests waiting in this worker.", registry=r)
        self.running = Gauge("distserve_num_requests_running", "Requests running in this worker.", registry=r)
        self.kv_blocks_used = Gauge("distserve_kv_blocks_used", "KV blocks in use.", registry=r)
        self.kv_blocks_free = Gauge("distserve_kv_blocks_free", "KV blocks free.", registry=r)
        self.idle_seconds = Gauge(
            "distserve_engine_idle_seconds",
            "Seconds the engine loop waited with no unfinished request (wall - step - idle = host work between steps).",
            registry=r,
        )
        self.prefill_phase_seconds = Histogram(
            "distserve_prefill_phase_seconds",
            "Prefill worker per-request phases: queued+step (add_request to "
            "the prefilled output), take_kv (gather on the engine thread), stage (export for the pull).",
            ["phase"],
            registry=r,
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5),
        )
        self.kv_cache_bytes = Gauge(
            "distserve_kv_cache_bytes", "Bytes of the KV cache allocated at startup.", registry=r
        )
        self.gpu_memory_utilization = Gauge(
            "distserve_gpu_memory_utilization",
            "Share of the device the KV sizing allowed this worker (0: sized by kv_cache_memory_mb or num_gpu_blocks).",
            registry=r,
        )
        self.staged_kv = Gauge("distserve_kv_staged_requests", "KV payloads staged for pull.", registry=r)
        self.steps = Gauge("distserve_engine_steps", "Engine steps so far.", registry=r)
        self.step_seconds = Gauge(
            "distserve_engine_step_seconds", "Seconds spent inside engine steps so far.", registry=r
        )
        self.step_cpu_seconds = Gauge(
            "distserve_engine_step_cpu_seconds",
            "CPU seconds of the engine thread inside engine steps so far.",
            registry=r,
        )
        self.generated = Gauge("distserve_engine_generated_tokens", "Tokens sampled so far.", registry=r)
        self.prefix_queried = Gauge(
            "distserve_prefix_cache_queried_tokens",
            "Tokens of admitted requests looked up in the prefix cache so far.",
            registry=r,
        )
        self.prefix_hits = Gauge(
            "distserve_prefix_cache_hit_tokens", "Tokens whose KV came from the prefix cache so far.", registry=r
        )
        self.preemptions = Gauge("distserve_num_preemptions", "Preemptions by recompute so far.", registry=r)
        self.memory_errors = Gauge(
            "distserve_memory_errors",
            "Engine steps (or their one-by-one retries) that failed for lack of device memory so far.",
            registry=r,
        )
        self.memory_errors_recent = Gauge(
            "distserve_memory_errors_recent",
            "Of those, the ones in the last 30 s (non-zero: /health says degraded).",
            registry=r,
        )
        self.prefill_seconds = Histogram(
            "distserve_prefill_seconds", "Prefill request time in this worker.", buckets=LATENCY_BUCKETS, registry=r
        )
        self.kv_transfer_seconds = Histogram(
            "distserve_kv_transfer_seconds", "KV pull time.", ["transport"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.kv_transfer_bytes = Counter("distserve_kv_transfer_bytes", "KV bytes pulled.", ["transport"], registry=r)
        self.kv_transfer_failures = Counter(
            "distserve_kv_transfer_failures", "Failed KV pulls.", ["transport"], registry=r
        )
        self.kv_gather_memory_waits = Counter(
            "distserve_kv_gather_memory_waits",
            "Prefills whose KV gather ran out of device memory and waited for the KV other hand-offs held here.",
            registry=r,
        )
        self.kv_reference_room_waits = Counter(
            "distserve_kv_reference_room_waits",
            "KV leases by reference that waited for room in the decode worker's pool (by_reference: on).",
            registry=r,
        )

    def set_kv_calibration(self, report: dict | None) -> None:
        """FP8 KV cache (engine.kv_calibration_report): per-layer scales and amax, calibration progress.
        The gauges are created on first use, so a worker without an FP8 cache exports none of them."""
        if report is None:
            return
        r = self.registry
        if not hasattr(self, "kv_scale"):
            self.kv_scale = Gauge(
                "distserve_kv_cache_scale",
                "FP8 KV cache scale per layer (x = q * scale).",
                ["layer", "kind"],
                registry=r,
            )
            self.kv_amax = Gauge(
                "distserve_kv_cache_amax",
                "Largest |K| or |V| written to the FP8 KV cache.",
                ["layer", "kind"],
                registry=r,
            )
            self.kv_calibrated = Gauge(
                "distserve_kv_cache_calibrated", "1 once the FP8 KV scales are calibrated, else 0.", registry=r
            )
            self.kv_calibration_requests = Gauge(
                "distserve_kv_cache_calibration_requests",
                "Finished requests counted for FP8 KV calibration.",
                registry=r,
            )
        for i, (scales, amax) in enumerate(zip(report["scales"], report["amax"])):
            for kind, sc, am in (("k", scales[0], amax[0]), ("v", scales[1], amax[1])):
                self.kv_scale.labels(str(i), kind).set(sc)
                self.kv_amax.labels(str(i), kind).set(am)
        self.kv_calibrated.set(1 if report["state"] == "calibrated" else 0)
        self.kv_calibration_requests.set(report["requests_seen"])

    def set_kv_cache(self, kv_bytes: int, gpu_memory_utilization: float) -> None:
        """Set once at startup: what the KV sizing decided (kv_sizing.KVBudget)."""
        self.kv_cache_bytes.set(kv_bytes)
        self.gpu_memory_utilization.set(gpu_memory_utilization)

    def refresh(self, status, loop_stats) -> None:
        self.queue_depth.set(status.num_waiting + status.num_reserving)
        self.running.set(status.num_running)
        self.kv_blocks_used.set(status.kv_blocks_used)
        self.kv_blocks_free.set(status.kv_blocks_free)
        self.staged_kv.set(status.num_staged_kv)
        self.steps.set(loop_stats.num_steps)
        self.step_seconds.set(loop_stats.step_seconds_total)
        self.step_cpu_seconds.set(loop_stats.step_cpu_seconds_total)
        self.idle_seconds.set(loop_stats.idle_seconds_total)
        self.generated.set(loop_stats.num_generated_tokens)
        self.prefix_queried.set(loop_stats.prefix_cache_queried_tokens)
        self.prefix_hits.set(loop_stats.prefix_cache_hit_tokens)
        self.preemptions.set(loop_stats.num_preemptions)
        self.memory_errors.set(loop_stats.num_memory_errors)
        self.memory_errors_recent.set(status.memory_errors_recent)
