"""What each Ray actor of a deployment asks for, and the deployment's frozen description.

Pure data (no Ray import): ``RaySpec`` travels to the controller actor; ``actor_options`` turns a pool's
resources (``ray.<pool>.resources`` in the config, ``--prefill-resources`` / ``--decode-resources`` on the
command line) into ``ray.remote`` options.
"""

from __future__ import annotations

from dataclasses import dataclass

ROLES = ("prefill", "decode", "colocated")


@dataclass(frozen=True)
class RaySpec:
    """One deployment: what ``distserve serve --launcher ray`` asked for."""

    deployment: str
    namespace: str
    mode: str  # disaggregated | colocated
    num_prefill: int
    num_decode: int  # decode workers, or colocated workers in colocated mode
    config_yaml: str  # the full configuration, written on each node next to its process
    token: str
    device: str = "cpu"
    router_host: str = "{node_ip}"  # the Ray node's address, so workers on other nodes reach it
    router_port: int = 8080
    served_model_name: str | None = None
    router_resources: tuple[tuple[str, float], ...] = ()
    prefill_resources: tuple[tuple[str, float], ...] = ()
    decode_resources: tuple[tuple[str, float], ...] = ()
    driver_node_id: str | None = None  # the router and the controller stay on this node by default
    drain_timeout_s: float = 120.0
    start_timeout_s: float = 300.0
    log_level: str = "INFO"
    max_restarts: int = 5
    restart_window_s: float = 60.0
    restart: bool = True

    def pool_resources(self, role: str) -> tuple[tuple[str, float], ...]:
        return self.prefill_resources if role == "prefill" else self.decode_resources


def actor_options(resources: tuple[tuple[str, float], ...], default_cpus: float, gpu: bool) -> dict:
    """``ray.remote`` options from Ray-style resources: ``CPU`` and ``GPU`` become ``num_cpus`` and
    ``num_gpus`` (CPU defaults to ``default_cpus``, GPU to 1 when the worker runs on CUDA); the rest are
    custom resources that only nodes started with them offer."""
    res = dict(resources)
    opts: dict = {"num_cpus": res.pop("CPU", default_cpus), "num_gpus": res.pop("GPU", 1.0 if gpu else 0.0)}
    if res:
        opts["resources"] = res
    return opts


def torch_threads(resources: tuple[tuple[str, float], ...], default_cpus: float) -> int:
    """One torch thread per CPU the actor holds (at least one): Ray does not pin, so threads are the bound."""
    return max(1, int(dict(resources).get("CPU", default_cpus)))


def parse_resources(text: str) -> dict[str, float]:
    """``'{"prefill_node": 1, "GPU": 1}'`` -> dict; ValueError with one sentence on bad input."""
    import json

    try:
        value = json.loads(text)
    except ValueError:
        raise ValueError(f"resources must be a JSON object such as '{{\"prefill_node\": 1}}', got {text!r}") from None
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and k and isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0
        for k, v in value.items()
    ):
        raise ValueError(f"resources must map resource names to amounts >= 0, got {text!r}")
    return {k: float(v) for k, v in value.items()}
