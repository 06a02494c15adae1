"""How workers that share one GPU split its memory (``distserve serve``, one plan per launch).

``cache.gpu_memory_utilization`` is the budget of the whole device: all the workers the launcher puts
on one GPU together may use that share of its memory. Each gets a part proportional to its role's
weight, ``prefill.memory_share`` for prefill workers and ``decode.memory_share`` for decode and
colocated ones (defaults 0.3 and 0.7: decode holds every running stream's KV for its whole
length, prefill only the prompts in flight until they are pulled). A worker alone on its GPU gets the
whole budget, as before. CPU workers are not sized from device memory and get no share.

    1 prefill + 1 decode on cuda:0, budget 0.9:  prefill 0.27, decode 0.63
    1 prefill + 2 decode on cuda:0:              prefill 0.159, decode 0.371 each

Each worker then sizes its KV cache inside its share (``server.engine.kv_sizing``) and refuses to
start when the share cannot hold what it needs.
"""

from __future__ import annotations

from distserve.server.config import DistServeConfig


def device_key(device: str) -> str | None:
    """The physical device a worker's device string names: 'cuda' is 'cuda:0'; None for CPU."""
    if not device.startswith("cuda"):
        return None
    return device if ":" in device else "cuda:0"


def role_weight(role: str, cfg: DistServeConfig) -> float:
    return cfg.prefill.memory_share if role == "prefill" else cfg.decode.memory_share


def plan_memory_shares(plan: list[tuple[str, str, str]], cfg: DistServeConfig) -> dict[str, float]:
    """{worker id: gpu_memory_utilization of its own} for the (role, worker id, device) plan; workers on
    CPU are left out, and so is everything when the config sizes KV without device memory
    (``cache.gpu_memory_utilization`` 0 or ``cache.num_gpu_blocks`` set)."""
    budget = cfg.cache.gpu_memory_utilization
    if budget <= 0 or cfg.cache.num_gpu_blocks:
        return {}
    totals: dict[str, float] = {}
    for role, _, device in plan:
        key = device_key(device)
        if key is not None:
            totals[key] = totals.get(key, 0.0) + role_weight(role, cfg)
    shares = {}
    for role, worker_id, device in plan:
        key = device_key(device)
        if key is not None:
            shares[worker_id] = round(budget * role_weight(role, cfg) / totals[key], 6)
    return shares


def shared_devices(plan: list[tuple[str, str, str]]) -> set[str]:
    """GPUs that more than one worker of the plan uses (their workers start one after another, so each
    measures its own memory use, not a neighbour's start-up)."""
    seen: dict[str, int] = {}
    for _, _, device in plan:
        key = device_key(device)
        if key is not None:
            seen[key] = seen.get(key, 0) + 1
    return {k for k, n in seen.items() if n > 1}
