"""A profile of the H200 (Llama-2-7B shape, bf16) built from recorded benchmark results, so plans for it can
be made without a GPU. Which point comes from where (files under the results folder):

measured
- prefill 1 x 2048: 48.3 ms, the engine step alone (``gpu_issue16/kv_sizing.json``: ``step_ms_median``);
- prefill 2 x 2048: twice the prefill worker's in-step time per prompt at two prompts per step
  (``gpu_issue16/prefill_after_out16.json``: ``per_prefill_ms.in_step`` 47.8 ms);
- decode 1 x 128: 4.84 ms and decode 64 x ~1045: 12.84 ms, engine ``step()`` with CUDA graphs
  (``gpu_engine_2026-11-29_run2.json``: ``engine_7b.decode_b1`` / ``decode_b64_ctx1024``);
- KV pull of 1 GiB (one 2048-token prompt) GPU 0 -> GPU 1 over cuda_ipc: 3.89 ms median, connection reused
  (``kv_transfer_gpu_x2_2026-11-29_run2.json``: ``cuda_ipc_pool.pull_s_median``).
derived
- prefill 1 x 128 and 1 x 512: the 2048 point split into the decode step's fixed part (4.84 ms: reading the
  weights once), attention (quadratic in the length: flash attention at 2048 measured 178 us per layer,
  ``prefill_parts.attn_flash``, x 32 layers) and the rest linear in tokens;
- decode 64 x 128: linear in the batch's total context between the two measured decode points (the step
  reads the weights once plus each sequence's KV);
- KV pull of 64 MiB (128 tokens): the 1 GiB pull's control phases (connect, PULL -> reply, ACK -> DONE) plus
  the copy scaled by bytes.
Everything beyond these (batches above 64 x 1045, more than two prompts per step) is a linear extrapolation
made by ``planner.latency``. Not in the profile: the serving path's host costs under load (HTTP, router,
staging threads); ``overhead_ttft_ms`` (6 ms) is the lowest-rate TTFT P50 of the two-GPU long study minus the
prefill step, the only calibration taken from a serving run.
"""

from __future__ import annotations

import json
from pathlib import Path

from planner.profile import DecodePoint, PrefillPoint, Profile, TransferPoint

KV_BYTES_PER_TOKEN = 32 * 2 * 32 * 128 * 2  # layers x (K, V) x heads x head dim x bf16 = 512 KiB


def _read(path: Path) -> dict:
    return json.loads(path.read_text())


def build_h200_profile(results: Path) -> Profile:
    eng = _read(results / "gpu_engine_2026-11-29_run2.json")["engine_7b"]
    sizing = _read(results / "gpu_issue16" / "kv_sizing.json")
    worker = _read(results / "gpu_issue16" / "prefill_after_out16.json")
    kvx = _read(results / "kv_transfer_gpu_x2_2026-11-29_run2.json")
    parts = _read(results / "gpu_engine_2026-11-29_run2.json")["prefill_parts"]

    d1 = eng["decode_b1"]["graphs"]["step_ms_median"]
    d64 = eng["decode_b64_ctx1024"]["graphs"]
    d64_ms, d64_ctx = d64["step_ms_median"], d64["mean_context"]
    p2048 = sizing["step_ms_median"]
    in_step = worker["per_prefill_ms"]["in_step"]
    attn_2048 = parts["attn_flash"]["us"] * 32 / 1000  # ms, all layers
    per_tok = (p2048 - d1 - attn_2048) / 2048
    per_tok2 = attn_2048 / 2048**2

    def derived_prefill(n: int) -> float:
        return d1 + per_tok * n + per_tok2 * n * n

    per_ctx = (d64_ms - d1) / (64 * d64_ctx - 128)
    pool = kvx["cuda_ipc_pool"]
    phases = pool["phases_s_median"]
    control_ms = (phases["connect_s"] + phases["pull_to_header_s"] + phases["ack_to_done_s"]) * 1000
    copy_ms_per_byte = phases["copy_s"] * 1000 / kvx["nbytes"]
    small = 128 * KV_BYTES_PER_TOKEN
    src = "from bench/results: "
    return Profile(
        device="cuda",
        device_name="NVIDIA H200 (from recorded results)",
        model="preset:llama-2-7b",
        kv_bytes_per_token=KV_BYTES_PER_TOKEN,
        devices_available=4,
        transport="cuda_ipc",
        prefill=(
            PrefillPoint(1, 2048, p2048, "measured", src + "gpu_issue16/kv_sizing.json step_ms_median"),
            PrefillPoint(2, 2048, 2 * in_step, "measured", src + "gpu_issue16/prefill_after_out16.json in_step x 2"),
            PrefillPoint(1, 512, derived_prefill(512), "derived", "fixed + linear + flash-attention share of 2048"),
            PrefillPoint(1, 128, derived_prefill(128), "derived", "fixed + linear + flash-attention share of 2048"),
        ),
        decode=(
            DecodePoint(1, 128, d1, "measured", src + "gpu_engine_2026-11-29_run2.json decode_b1 graphs"),
            DecodePoint(64, round(d64_ctx), d64_ms, "measured", src + "gpu_engine_2026-11-29_run2.json decode_b64"),
            DecodePoint(64, 128, d1 + per_ctx * (64 * 128 - 128), "interpolated", "linear in total context"),
        ),
        kv_transfer=(
            TransferPoint(
                kvx["nbytes"],
                pool["pull_s_median"] * 1000,
                "measured",
                src + "kv_transfer_gpu_x2_2026-11-29_run2.json cuda_ipc_pool, GPU 0 -> GPU 1",
            ),
            TransferPoint(small, control_ms + copy_ms_per_byte * small, "derived", "control phases + scaled copy"),
        ),
        overhead_ttft_ms=6.0,
        notes=(
            "built by `distserve profile --from-results`; see planner/from_results.py for each point's source",
            "one GPU per worker; decode with CUDA graphs; prefill default max_num_batched_tokens 4096",
        ),
    )
