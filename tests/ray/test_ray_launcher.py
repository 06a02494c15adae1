"""``distserve serve --launcher ray`` and ``distserve scale`` on a real two-node Ray cluster on this machine.

The cluster: a head on 127.0.0.2 offering ``prefill_node: 2, decode_node: 1`` and a second ``ray start``
node on 127.0.0.3 offering ``decode_node: 1`` (CPU only, its own ports and temp dir, stopped by PID). The
deployment: one prefill worker asking for ``prefill_node`` and two decode workers asking for ``decode_node``,
so Ray must put one decode worker on each node. KV crosses nodes over ``tcp``.

In order (module-scoped cluster and deployment, to keep the file to a few minutes on two cores):
placement; scale up and down under distbench load with zero failed requests and drained workers that
left no KV behind; the second node's raylet killed mid-load with zero failed requests, then the lost
decode worker replaced on a third node that joins.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.ray.cluster import RayCluster

pytestmark = [pytest.mark.ray, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
CONFIG = """
kv_transfer: {transport: tcp}
cache: {kv_cache_memory_mb: 16}
prefill: {attention_backend: sdpa}
decode: {attention_backend: sdpa}
router: {heartbeat_interval_ms: 500}
ray: {drain_timeout_s: 60, start_timeout_s: 240}
"""


def _env() -> dict:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}


def _get(url: str, token: str) -> dict:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def _wait(pred, what: str, timeout_s: float = 180.0, every: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = RayCluster(tmp_path_factory.mktemp("ray"), _env())
    try:
        c.start_head(num_cpus=4, resources={"prefill_node": 2, "decode_node": 1})
        c.add_node("node2", "127.0.0.3", num_cpus=4, resources={"decode_node": 1})
        c.wait_nodes(2)
        yield c
    finally:
        c.stop()


class Deployment:
    def __init__(self, cluster: RayCluster, root: Path) -> None:
        self.cluster, self.root = cluster, root
        (root / "config.yaml").write_text(CONFIG)
        self.ready = root / "ready.json"
        self.log = open(root / "serve.log", "wb")  # noqa: SIM115 - open while the process runs
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "distserve.server.cli",
                "serve",
                "--launcher",
                "ray",
                "--address",
                cluster.address,
                "--config",
                str(root / "config.yaml"),
                "--port",
                "0",
                "--prefill",
                "1",
                "--decode",
                "2",
                "--prefill-resources",
                '{"prefill_node": 1}',
                "--decode-resources",
                '{"decode_node": 1}',
                "--ready-file",
                str(self.ready),
            ],
            cwd=REPO,
            env=cluster.env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        _wait(lambda: self.ready.exists() or self.proc.poll() is not None, "the deployment", 400)
        assert self.proc.poll() is None, (root / "serve.log").read_text()[-4000:]
        info = json.loads(self.ready.read_text())
        self.url, self.token = info["url"], info["token"]

    def workers(self) -> list[dict]:
        return _get(f"{self.url}/v1/workers", self.token)["workers"]

    def scale(self, *args: str) -> dict:
        r = subprocess.run(
            [sys.executable, "-m", "distserve.server.cli", "scale", "--address", self.cluster.address, *args],
            cwd=REPO,
            env=self.cluster.env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert r.returncode == 0, f"scale {args}: {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"
        return json.loads(r.stdout)

    def load(self, name: str, duration_s: int) -> tuple[subprocess.Popen, Path]:
        """Closed loop, 4 users: every worker has requests in flight whenever a scale or a kill hits it."""
        out = self.root / f"{name}.json"
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "distserve.distbench.cli",
                "run",
                "--url",
                self.url,
                "--concurrency",
                "4",
                "--duration",
                str(duration_s),
                "--prompt-len",
                "24",
                "--output-len",
                "48",
                "--timeout",
                "120",
                "--no-progress",
                "--save-result",
                str(out),
            ],
            cwd=REPO,
            env=self.cluster.env,
            stdout=open(self.root / f"{name}.log", "wb"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return proc, out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def deployment(cluster, tmp_path_factory):
    d = Deployment(cluster, tmp_path_factory.mktemp("deployment"))
    try:
        yield d
    finally:
        d.stop()
        print((d.root / "serve.log").read_text()[-3000:])


def _finished(proc: subprocess.Popen, out: Path, stop: bool = False) -> dict:
    """distbench's result, asserting no request failed; ``stop``: end the load now (SIGTERM: distbench
    stops sending and lets the requests in flight finish)."""
    if stop:
        assert proc.poll() is None, "the load ended before the test was done with it"
        proc.send_signal(signal.SIGTERM)
    assert proc.wait(300) == 0 or out.exists(), f"distbench exited {proc.returncode}"
    result = json.loads(out.read_text())
    errors = [e for e in result["errors"] if e]
    assert result["failed"] == 0 and not errors, errors[:5]
    assert result["completed"] == result["num_prompts"] > 0
    return result


def _idle(d: Deployment) -> bool:
    ws = d.workers()
    return all(
        w["state"] == "healthy" and w["inflight"] == 0 and w["kv_blocks_used"] == 0 and w["num_staged_kv"] == 0
        for w in ws
    )


def test_no_cluster_at_the_address_is_one_sentence_in_seconds():
    from tests.ray.cluster import free_port

    address = f"127.0.0.2:{free_port('127.0.0.2')}"  # nothing listens there
    for argv in (["scale", "--address", address], ["serve", "--launcher", "ray", "--address", address]):
        r = subprocess.run(
            [sys.executable, "-m", "distserve.server.cli", *argv],
            cwd=REPO,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 1 and f"no Ray cluster answers at {address}" in r.stderr, r.stderr


def test_workers_land_where_their_resources_ask(deployment):
    status = deployment.scale()  # no --prefill/--decode: the deployment's status
    by_id = {w["worker_id"]: w for w in status["workers"]}
    assert status["layout"] == {"prefill": 1, "decode": 2}
    assert by_id["prefill-0"]["node_ip"] == "127.0.0.2"  # only the head offers prefill_node
    assert {by_id["decode-0"]["node_ip"], by_id["decode-1"]["node_ip"]} == {"127.0.0.2", "127.0.0.3"}
    router = {w["worker_id"]: w for w in deployment.workers()}
    assert all(w["healthy"] for w in router.values()) and len(router) == 3
    for wid, w in by_id.items():  # each process listens on its own node's address and registered from there
        assert router[wid]["url"].startswith(f"http://{w['node_ip']}:") and router[wid]["pid"] == w["pid"]


def test_scale_up_and_down_under_load_loses_no_request(deployment):
    proc, out = deployment.load("scale", 900)  # stopped below, once every scale step is done
    time.sleep(4)
    up = deployment.scale("--prefill", "2")
    assert [w["worker_id"] for w in up["joined"]] == ["prefill-1"] and up["layout"]["prefill"] == 2
    assert up["joined"][0]["node_ip"] == "127.0.0.2"
    _wait(
        lambda: (
            next(w for w in deployment.workers() if w["worker_id"] == "prefill-1")["join_to_first_request_ms"]
            is not None
        ),
        "a request routed to the new prefill worker",
        60,
    )
    joined = next(w for w in deployment.workers() if w["worker_id"] == "prefill-1")
    print(
        f"join-to-first-request prefill-1: {joined['join_to_first_request_ms']} ms; "
        f"scale call to registered: {up['joined'][0]['start_to_registered_s']} s"
    )
    down = deployment.scale("--prefill", "1", "--decode", "1")
    left = {w["worker_id"]: w for w in down["left"]}
    assert set(left) == {"prefill-1", "decode-1"}  # the newest of each pool leave
    for w in left.values():  # drained: idle before it left (not cut by the timeout), no KV block held
        assert w["idle"] and w["kv_blocks_used"] == 0 and w["exit_status"] == 0, w
    print("drains: " + ", ".join(f"{w['worker_id']} {w['seconds']} s" for w in left.values()))
    assert down["layout"] == {"prefill": 1, "decode": 1}
    assert {w["worker_id"] for w in deployment.workers()} == {"prefill-0", "decode-0"}
    again = deployment.scale("--decode", "2")
    assert [w["worker_id"] for w in again["joined"]] == ["decode-2"]
    time.sleep(2)
    result = _finished(proc, out, stop=True)
    print(f"scale under load: {result['completed']} requests completed, {result['failed']} failed")
    _wait(lambda: _idle(deployment), "every worker idle with no KV block in use after the load", 60)


def test_losing_a_node_mid_load_loses_no_request_and_the_worker_is_replaced(deployment, cluster):
    node2 = cluster.nodes[1]
    lost = [w for w in deployment.scale()["workers"] if w["node_ip"] == node2.ip]
    assert [w["role"] for w in lost] == ["decode"]
    lost_id = lost[0]["worker_id"]
    proc, out = deployment.load("node_loss", 30)
    time.sleep(8)
    raylet = node2.raylet_pid()
    assert raylet is not None
    os.kill(raylet, signal.SIGKILL)  # the node's raylet dies: Ray loses the node and every actor on it
    result = _finished(proc, out)
    print(f"node loss under load: {result['completed']} requests completed, {result['failed']} failed")
    # no other node offers decode_node: the replacement waits for one; a third node joins and gets it
    _wait(
        lambda: (
            next(w for w in deployment.scale()["workers"] if w["worker_id"] == lost_id)["state"]
            in ("pending", "restarting")
        ),
        "the lost worker to wait for a node",
        120,
    )
    cluster.add_node("node3", "127.0.0.4", num_cpus=4, resources={"decode_node": 1})

    def replaced():
        w = next(w for w in deployment.scale()["workers"] if w["worker_id"] == lost_id)
        return w if w["state"] == "running" else None

    w = _wait(replaced, "the replacement to register from the third node", 300, every=2)
    # >= 1: a first replacement may be sent to the dead node before Ray has declared it dead
    assert w["node_ip"] == "127.0.0.4" and w["restart_count"] >= 1
    router = {x["worker_id"]: x for x in deployment.workers()}
    assert router[lost_id]["healthy"] and router[lost_id]["url"].startswith("http://127.0.0.4:")
    proc, out = deployment.load("after_replacement", 5)
    _finished(proc, out)
