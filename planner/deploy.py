"""What deploys a layout: the ``distserve serve`` command line and the config keys that differ from the
base config (batch limits, torch threads), as YAML text."""

from __future__ import annotations

from distserve.planner.layouts import Layout


def config_overrides(layout: Layout, base_decode_max_batch: int, device: str) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    dec: dict[str, int] = {}
    if layout.decode.max_num_seqs != base_decode_max_batch:
        dec["max_batch_size"] = layout.decode.max_num_seqs
        if layout.mode == "disaggregated":
            dec["max_concurrent_requests"] = layout.decode.max_num_seqs
    if device == "cpu":
        dec["torch_threads"] = layout.decode_threads
        if layout.mode == "disaggregated":
            out["prefill"] = {"torch_threads": layout.prefill_threads}
    if dec:
        out["decode"] = dec
    return out


def to_yaml(overrides: dict[str, dict[str, int]], model: str, base: str | None = None) -> str:
    """The winner's config: what differs from the defaults, or, given ``base`` (the plan's --config), that
    file with the winner's settings merged in, so `serve --config` with it keeps the rest of ``base``."""
    if base:
        import yaml

        from distserve.configs import find as find_config

        with open(find_config(base)) as f:
            merged = yaml.safe_load(f) or {}
        for section, keys in overrides.items():
            merged[section] = {**(merged.get(section) or {}), **keys}
        if model and not merged.get("model"):
            merged = {"model": model, **merged}
        return f"# written by `distserve plan`: {base} with the winner's settings\n" + yaml.safe_dump(
            merged, sort_keys=False
        )
    lines = ["# written by `distserve plan`: only what differs from the defaults"]
    if model:
        lines.append(f"model: {model}")
    for section, keys in overrides.items():
        lines.append(f"{section}:")
        lines += [f"  {k}: {v}" for k, v in keys.items()]
    return "\n".join(lines) + "\n"


def serve_command(layout: Layout, device: str, model: str, config_path: str | None) -> str:
    parts = ["distserve serve"]
    if config_path:
        parts.append(f"--config {config_path}")
    elif model:
        parts.append(f"--model {model}")
    if layout.mode == "colocated":
        parts.append(f"--mode colocated --decode {layout.num_decode}")
    else:
        parts.append(f"--mode disaggregated --prefill {layout.num_prefill} --decode {layout.num_decode}")
    if device != "cpu" and layout.sm_split:
        parts.append(f"--devices cuda:0 --sm-split {layout.sm_split[0]}:{layout.sm_split[1]}")
    elif device != "cpu":
        n = layout.workers
        parts.append(f"--devices {','.join(f'cuda:{i}' for i in range(n))}")
    elif layout.mode == "colocated" and layout.num_decode > 1:
        parts.append("--cpu-pinning none")
    return " ".join(parts)
