"""``distserve serve --launcher ray`` (the driver) and ``distserve scale`` (a client of the controller).

The driver connects to the Ray cluster, creates the deployment's controller actor on its own node
(``ray_controller.py``), waits until the router and every worker have registered, prints the ready line,
then relays the controller's events until Ctrl-C / SIGTERM, when it stops the deployment. ``scale``
connects to the same cluster and namespace, finds the controller by name and asks it for a new layout.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from distserve.server.launchers.ray_controller import remote_controller
from distserve.server.launchers.ray_placement import RaySpec


class ClusterUnreachable(Exception):
    """No Ray cluster answers at the address (one sentence, for the CLI)."""


def connect(address: str | None, namespace: str, quiet: bool) -> None:
    """Join the cluster as a driver (``address`` None: $RAY_ADDRESS, else the cluster on this machine).

    A HOST:PORT that does not accept connections fails in seconds with ``ClusterUnreachable``;
    ``ray.init`` alone would retry for minutes."""
    address = address or os.environ.get("RAY_ADDRESS") or "auto"
    host, _, port = address.rpartition(":")
    if host and port.isdigit() and "://" not in address:
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
        except OSError as e:
            raise ClusterUnreachable(
                f"no Ray cluster answers at {address} ({e.strerror or e}); start one with "
                f"`ray start --head` or pass --address HEAD_IP:PORT"
            ) from None
    try:
        ray.init(
            address=address,
            namespace=namespace,
            logging_level=logging.ERROR if quiet else logging.WARNING,
            log_to_driver=not quiet,
        )
    except ConnectionError as e:
        raise ClusterUnreachable(f"cannot connect to a Ray cluster at {address}: {str(e).splitlines()[0]}") from None


def serve(spec: RaySpec, address: str | None, ready_file: str | None) -> int:
    from distserve.server.private_files import write_ready_file

    connect(address, spec.namespace, quiet=False)
    node_id = ray.get_runtime_context().get_node_id()
    spec = RaySpec(**{**spec.__dict__, "driver_node_id": node_id})
    try:  # the controller (and by default the router) live on this node: losing another node spares them
        controller = (
            remote_controller()
            .options(
                name=spec.deployment,
                namespace=spec.namespace,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            )
            .remote(spec)
        )
    except ValueError:
        print(
            f"distserve: error: a deployment named {spec.deployment!r} already runs in Ray namespace "
            f"{spec.namespace!r}; stop it or choose another ray.deployment",
            file=sys.stderr,
        )
        return 1
    stop = {"flag": False}
    signal.signal(signal.SIGINT, lambda *_: stop.update(flag=True))
    signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))
    seen = 0
    try:
        start = controller.start.remote()
        while True:  # wait for start, relaying events (a placement can take a while on a busy cluster)
            seen = _relay(controller, seen)
            if stop["flag"]:
                return 0
            try:
                url = ray.get(start, timeout=0.5)
                break
            except GetTimeoutError:
                continue
        if ready_file:
            write_ready_file(
                ready_file,
                {
                    "url": url,
                    "pid": os.getpid(),
                    "token": spec.token,
                    "deployment": spec.deployment,
                    "namespace": spec.namespace,
                },
            )
        n = (
            f"{spec.num_prefill} prefill + {spec.num_decode} decode"
            if spec.mode == "disaggregated"
            else f"{spec.num_decode} colocated"
        )
        print(
            f"distserve ready: {url} ({spec.mode}, {n} workers, on Ray: deployment {spec.deployment!r} in "
            f"namespace {spec.namespace!r})",
            flush=True,
        )
        while not stop["flag"]:
            seen = _relay(controller, seen)
            status = ray.get(controller.status.remote(), timeout=30)
            if status["router_exit_status"] is not None:
                print("distserve: router exited; shutting down", file=sys.stderr)
                return 1
            time.sleep(0.5)
        return 0
    except (RuntimeError, RayActorError, ray.exceptions.RayTaskError) as e:
        print(f"distserve: error: {_cause(e)}", file=sys.stderr)
        return 1
    finally:
        try:
            ray.get(controller.shutdown.remote(), timeout=60)
            _relay(controller, seen)
        except Exception:  # noqa: BLE001 - the controller is gone already: its actors went with it
            pass
        ray.kill(controller)
        ray.shutdown()


def _relay(controller: Any, seen: int) -> int:
    for seq, text in ray.get(controller.events.remote(seen), timeout=30):
        print(f"distserve: {text}", file=sys.stderr, flush=True)
        seen = seq
    return seen


def _cause(e: BaseException) -> str:
    cause = getattr(e, "cause", None)
    return str(cause) if cause is not None else str(e).strip().splitlines()[-1]


def find_controller(address: str | None, namespace: str, deployment: str) -> Any:
    connect(address, namespace, quiet=True)
    try:
        return ray.get_actor(deployment, namespace=namespace)
    except ValueError:
        return None


def scale(controller: Any, prefill: int | None, decode: int | None, timeout_s: float) -> dict:
    return ray.get(controller.scale.remote(prefill, decode), timeout=timeout_s)


def status(controller: Any) -> dict:
    return ray.get(controller.status.remote(), timeout=30)
