"""``distserve serve --launcher ray`` and ``distserve scale``: the command-line side of the Ray launcher.

Ray is an optional extra (``pip install 'distserve[ray]'``) and is imported only here, inside the
handlers; the local launcher never touches it.
"""

from __future__ import annotations

import argparse
import json
import sys

from distserve.server.commands.common import admin_token, load_args_config, usage_error
from distserve.server.config import ConfigError, DistServeConfig

NEEDS_RAY = (
    "the Ray launcher needs Ray (ray>=2.40): pip install -e '.[ray]' in a distserve checkout "
    "('distserve[ray]' where distserve comes from an index)"
)


def _have_ray() -> bool:
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


def _ray_overrides(args) -> dict:
    """``--address``, ``--prefill-resources``, ``--decode-resources`` ... as config overrides (ValueError)."""
    from distserve.server.launchers.ray_placement import parse_resources

    ray: dict = {}
    if getattr(args, "address", None):
        ray["address"] = args.address
    if getattr(args, "deployment", None):
        ray["deployment"] = args.deployment
    if getattr(args, "namespace", None):
        ray["namespace"] = args.namespace
    for role in ("prefill", "decode"):
        text = getattr(args, f"{role}_resources", None)
        if text:
            try:
                ray[role] = {"resources": parse_resources(text)}
            except ValueError as e:
                raise ValueError(f"--{role}-resources: {e}") from None
    return ray


def serve_on_ray(args, cfg: DistServeConfig) -> int:
    """The ``serve`` command's Ray branch (its arguments are validated by ``cmd_serve`` already)."""
    if args.devices or args.log_dir:
        return usage_error(
            "--devices and --log-dir are for the local launcher; on Ray each worker asks for GPU "
            "resources (ray.prefill/decode.resources) and its logs stream to this terminal"
        )
    try:
        cfg = DistServeConfig.from_dict({**cfg.to_dict(), "ray": {**cfg.ray.to_dict(), **_ray_overrides(args)}})
    except (ValueError, ConfigError) as e:
        return usage_error(str(e))
    if not _have_ray():
        return usage_error(NEEDS_RAY)
    import yaml

    from distserve.server.launchers import ray_serve
    from distserve.server.launchers.ray_placement import RaySpec

    host = args.host or (cfg.router.host if cfg.router.host != "127.0.0.1" else "{node_ip}")
    import logging

    spec = RaySpec(
        deployment=cfg.ray.deployment,
        namespace=cfg.ray.namespace,
        mode=args.mode,
        num_prefill=args.prefill,
        num_decode=args.decode,
        config_yaml=yaml.safe_dump(cfg.to_dict()),
        token=admin_token(cfg, generate=True) or "",
        device=args.device,
        router_host=host,
        router_port=cfg.router.port,
        served_model_name=args.served_model_name,
        router_resources=cfg.ray.router.resources,
        prefill_resources=cfg.ray.prefill.resources,
        decode_resources=cfg.ray.decode.resources,
        drain_timeout_s=cfg.ray.drain_timeout_s,
        start_timeout_s=cfg.ray.start_timeout_s,
        log_level=logging.getLevelName(logging.getLogger().level),
        max_restarts=args.max_restarts,
        restart_window_s=args.restart_window_s,
        restart=args.restart == "always",
    )
    try:
        return ray_serve.serve(spec, cfg.ray.address, args.ready_file)
    except ray_serve.ClusterUnreachable as e:
        print(f"distserve: error: {e}", file=sys.stderr)
        return 1


def cmd_scale(args) -> int:
    try:
        cfg = load_args_config(args)
        cfg = DistServeConfig.from_dict({**cfg.to_dict(), "ray": {**cfg.ray.to_dict(), **_ray_overrides(args)}})
    except (ValueError, ConfigError) as e:
        return usage_error(str(e))
    for flag, n in (("--prefill", args.prefill), ("--decode", args.decode)):
        if n is not None and n < 1:
            return usage_error(f"{flag} must be >= 1 (a pool cannot be empty; stop the deployment instead)")
    if args.timeout_s <= 0:
        return usage_error("--timeout-s must be > 0")
    if not _have_ray():
        return usage_error(NEEDS_RAY)
    from distserve.server.launchers import ray_serve

    try:
        controller = ray_serve.find_controller(cfg.ray.address, cfg.ray.namespace, cfg.ray.deployment)
    except ray_serve.ClusterUnreachable as e:
        print(f"distserve: error: {e}", file=sys.stderr)
        return 1
    if controller is None:
        print(
            f"distserve: error: no deployment named {cfg.ray.deployment!r} in Ray namespace "
            f"{cfg.ray.namespace!r} (is `distserve serve --launcher ray` running on this cluster?)",
            file=sys.stderr,
        )
        return 1
    if args.prefill is None and args.decode is None:
        print(json.dumps(ray_serve.status(controller), indent=2))
        return 0
    try:
        report = ray_serve.scale(controller, args.prefill, args.decode, args.timeout_s)
    except Exception as e:  # noqa: BLE001 - GetTimeoutError, the controller gone: one sentence, status 1
        print(
            f"distserve: error: scaling did not finish: {type(e).__name__}: {str(e).splitlines()[0]}", file=sys.stderr
        )
        return 1
    print(json.dumps(report, indent=2))
    return 1 if report["pending"] else 0


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    """The ``serve`` command's Ray flags."""
    p.add_argument(
        "--launcher",
        choices=["local", "ray"],
        default="local",
        help="local: child processes of this one; ray: Ray actors placed on a Ray cluster's nodes by "
        "resources (needs the ray extra)",
    )
    _cluster_flags(p)
    p.add_argument(
        "--prefill-resources",
        default=None,
        help='--launcher ray: Ray resources per prefill worker as JSON, e.g. \'{"prefill_node": 1, '
        '"GPU": 1}\' (default: config ray.prefill.resources; CPU 1, GPU 1 on CUDA)',
    )
    p.add_argument(
        "--decode-resources",
        default=None,
        help="--launcher ray: Ray resources per decode or colocated worker, as --prefill-resources",
    )


def _cluster_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--address",
        default=None,
        help="Ray cluster address HOST:PORT (default: config ray.address, else $RAY_ADDRESS, else the "
        "cluster this machine belongs to)",
    )
    p.add_argument("--deployment", default=None, help="name of the deployment (default: config ray.deployment)")
    p.add_argument("--namespace", default=None, help="Ray namespace (default: config ray.namespace)")


def add_parsers(sub) -> None:
    p = sub.add_parser(
        "scale",
        help="grow or shrink the pools of a deployment running on Ray",
        description="Resize a deployment started with `distserve serve --launcher ray`. New workers "
        "are placed by their pool's Ray resources and join the router when registered; "
        "leaving workers drain first (no new request, requests in flight finish or "
        "migrate, KV freed), then deregister and exit. Prints a JSON report; without "
        "--prefill/--decode prints the deployment's status. Example: distserve scale "
        "--address 10.0.0.1:6379 --prefill 4 --decode 2",
    )
    p.add_argument("--config", default=None, help="YAML config; its ray section gives the defaults below")
    _cluster_flags(p)
    p.add_argument("--prefill", type=int, default=None, help="prefill workers wanted (default: unchanged)")
    p.add_argument(
        "--decode",
        type=int,
        default=None,
        help="decode workers wanted, or colocated workers in colocated mode (default: unchanged)",
    )
    p.add_argument(
        "--timeout-s",
        type=float,
        default=900.0,
        help="give up waiting for the new layout after this long (the controller keeps working on it)",
    )
    p.set_defaults(handler=cmd_scale)
