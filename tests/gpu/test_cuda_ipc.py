"""cuda_ipc KV transport between two real processes: round trip, ACK before free, bad handles.

Skipped without CUDA. The sender (a KVStagingServer) lives in the test process; the receiver is a
child process that pulls handles given to it on stdin and answers with a digest of what landed on
its GPU. A fake sender in the test process answers PULLs with forged DATA_CUDA_IPC frames.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

REPO = Path(__file__).resolve().parents[2]

_CHILD = textwrap.dedent("""
    import hashlib, json, sys, torch
    from distserve.server.kv_transfer import KVHandle, KVPuller
    pullers = {}
    for line in sys.stdin:
        req = json.loads(line)
        dev = req["device"]
        puller = pullers.setdefault(dev, KVPuller(cuda_device=dev))
        r = puller.pull(KVHandle.from_dict(req["handle"]), 20)
        out = {"status": r.status.value, "error": r.error, "sha": None, "device": None}
        if r.ok:
            t = r.tensor
            out["device"] = str(t.device)
            out["sha"] = hashlib.sha256(t.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()
        print(json.dumps(out), flush=True)
""")


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


class Child:
    def __init__(self):
        env = dict(os.environ, PYTHONPATH=str(REPO))
        self.p = subprocess.Popen(
            [sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=REPO
        )

    def pull(self, handle, device: str = "cuda:0") -> dict:
        d = handle if isinstance(handle, dict) else handle.to_dict()
        self.p.stdin.write(json.dumps({"handle": d, "device": device}) + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        assert line, f"receiver process died (exit {self.p.poll()})"
        return json.loads(line)

    def close(self):
        self.p.stdin.close()
        self.p.wait(30)


@pytest.fixture(scope="module")
def child():
    c = Child()
    yield c
    c.close()


DEVICES = [f"cuda:{i}" for i in range(torch.cuda.device_count())]


def _kv(tokens: int = 64, seed: int = 0, device: str = "cuda:0") -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(4, 2, tokens, 4, 128, generator=g, device=device, dtype=torch.float32).to(torch.bfloat16)


@pytest.mark.parametrize("pool_mb", [64, 0], ids=["pool", "own-export"])
@pytest.mark.parametrize("dst", DEVICES)
def test_round_trip(child, pool_mb, dst):
    from distserve.server.kv_transfer import KVStagingServer, TransferStatus

    with KVStagingServer(cuda_ipc_pool_bytes=pool_mb << 20) as srv:
        for i in range(3):  # the same pool region / allocator blocks are reused between rounds
            kv = _kv(seed=i)
            want = _sha(kv)
            h = srv.stage(f"r{i}", kv, transport="cuda_ipc", ready_event=None)
            assert h.transport == "cuda_ipc" and h.checksum is None
            r = child.pull(h, dst)
            assert r["status"] == "success", r["error"]
            assert r["sha"] == want and r["device"] == dst
            assert srv.poll(f"r{i}") is TransferStatus.SUCCESS and srv.num_staged == 0


def test_own_export_frees_after_ack(child):
    """No block left in torch's IPC limbo: allocated bytes come back to where they were."""
    from distserve.server.kv_transfer import KVStagingServer

    torch.cuda.synchronize()
    with KVStagingServer(cuda_ipc_pool_bytes=0) as srv:
        base = torch.cuda.memory_allocated()
        for i in range(3):
            h = srv.stage(f"f{i}", _kv(tokens=512, seed=i), transport="cuda_ipc")
            assert torch.cuda.memory_allocated() > base
            assert child.pull(h)["status"] == "success"
        _until(lambda: torch.cuda.memory_allocated() == base)  # freed right after the ACK'd close
        assert torch.cuda.memory_allocated() == base


def _until(cond, timeout_s: float = 5.0) -> None:
    import time

    end = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < end:
        time.sleep(0.01)


def _raw_pull(address: str, rid: str, secret: str):
    from distserve.server.kv_transfer.base import parse_address
    from distserve.server.kv_transfer.frame import Frame, FrameType, encode_frame, read_frame

    sock = socket.create_connection(parse_address(address), timeout=10)
    sock.sendall(encode_frame(Frame(FrameType.PULL, request_id=rid, secret=secret)))
    return sock, read_frame(sock)


def test_ack_before_free(child):
    from distserve.server.kv_transfer import KVStagingServer, TransferStatus
    from distserve.server.kv_transfer.frame import Frame, FrameType, encode_frame

    with KVStagingServer(cuda_ipc_pool_bytes=16 << 20) as srv:
        kv = _kv(seed=7)
        nbytes = kv.numel() * kv.element_size()
        h = srv.stage("a", kv, transport="cuda_ipc")
        pool = next(iter(srv._ipc_pools.values()))
        assert pool.free_bytes <= (16 << 20) - nbytes
        # 1. a receiver that reads the handle and goes away without ACK: still staged, bytes kept
        sock, frame = _raw_pull(h.address, "a", h.secret)
        assert frame.type is FrameType.DATA_CUDA_IPC and json.loads(frame.text)["pool"] == pool.id
        assert srv.poll("a") is TransferStatus.TRANSFERRING
        sock.close()
        for _ in range(100):
            if srv.poll("a") is TransferStatus.PENDING:
                break
            threading.Event().wait(0.02)
        assert srv.poll("a") is TransferStatus.PENDING and srv.num_staged == 1
        assert pool.free_bytes <= (16 << 20) - nbytes
        # 2. holding the handle (no ACK yet): nothing freed; ACK: freed
        sock, frame = _raw_pull(h.address, "a", h.secret)
        assert srv.num_staged == 1 and pool.free_bytes <= (16 << 20) - nbytes
        sock.sendall(encode_frame(Frame(FrameType.ACK, request_id="a")))
        sock.settimeout(5)
        from distserve.server.kv_transfer.frame import read_frame

        # the sender unstages, answers DONE (the connection stays open for the next PULL), frees
        assert read_frame(sock, max_nbytes=0) == Frame(FrameType.DONE, request_id="a")
        sock.close()
        _until(lambda: pool.free_bytes == 16 << 20)
        assert srv.num_staged == 0 and pool.free_bytes == 16 << 20
        assert srv.poll("a") is TransferStatus.SUCCESS
        # 3. after a failed attempt the real receiver still gets the right bytes
        h2 = srv.stage("b", _kv(seed=8), transport="cuda_ipc")
        sock, _ = _raw_pull(h2.address, "b", h2.secret)
        sock.close()
        r = child.pull(h2)
        assert r["status"] == "success" and r["sha"] == _sha(_kv(seed=8))


def test_pool_handle_carries_description_and_early_copy_is_discarded_when_expired(child):
    """A pool handle names its bytes, so the receiver copies before the PULL's reply; when the
    entry has expired meanwhile (its region reused by another request) the pull fails as expired
    instead of returning the other request's bytes."""
    import time

    from distserve.server.kv_transfer import KVStagingServer

    with KVStagingServer(cuda_ipc_pool_bytes=16 << 20) as srv:
        h = srv.stage("x", _kv(seed=1), transport="cuda_ipc", lease_ms=50)
        assert h.ipc and json.loads(h.ipc)["pool"]
        _until(lambda: srv.num_staged == 0)
        time.sleep(0.1)
        h_other = srv.stage("y", _kv(seed=2), transport="cuda_ipc")  # first fit: the same region
        assert json.loads(h_other.ipc)["off"] == json.loads(h.ipc)["off"]
        r = child.pull(h)
        assert r["status"] == "expired" and r["sha"] is None
        r = child.pull(h_other)
        assert r["status"] == "success" and r["sha"] == _sha(_kv(seed=2))


class FakeSender:
    """Answers every PULL with a DATA_CUDA_IPC frame whose description text we choose."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.text = ""
        self.replies: list = []
        threading.Thread(target=self._loop, daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.listener.getsockname()[1]}"

    def _loop(self):
        from distserve.server.kv_transfer.frame import Frame, FrameType, encode_frame, read_frame

        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                try:
                    pull = read_frame(conn, max_nbytes=0)
                    conn.sendall(
                        encode_frame(
                            Frame(
                                FrameType.DATA_CUDA_IPC,
                                request_id=pull.request_id,
                                dtype=torch.bfloat16,
                                shape=(4, 2, 64, 4, 128),
                                nbytes=4 * 2 * 64 * 4 * 128 * 2,
                                text=self.text,
                            )
                        )
                    )
                    self.replies.append(read_frame(conn, max_nbytes=0))
                except (OSError, ValueError) as e:
                    self.replies.append(e)

    def handle(self, rid: str) -> dict:
        from distserve.server.kv_transfer.factory import host_id

        return {
            "request_id": rid,
            "transport": "cuda_ipc",
            "address": self.address,
            "secret": secrets.token_hex(16),
            "nbytes": 4 * 2 * 64 * 4 * 128 * 2,
            "shape": [4, 2, 64, 4, 128],
            "dtype": "bfloat16",
            "checksum": None,
            "host_id": host_id(),
        }


def _desc(**over) -> str:
    from distserve.server.kv_transfer.cuda_ipc import gpu_uuid

    d = {
        "v": 1,
        "pool": "",
        "dev": gpu_uuid(0),
        "handle": (bytes([2, ord("c")]) + os.urandom(64)).hex(),
        "size": 1 << 20,
        "soff": 0,
        "off": 0,
        "event": bytes(64).hex(),
        "sync": False,
    }
    d.update(over)
    return json.dumps(d)


@pytest.mark.parametrize(
    "case,err",
    [
        ("random handle", "opening the CUDA IPC handle failed"),
        ("expandable segment", "not a plain cudaMalloc"),
        ("outside storage", "outside the exported storage"),
        ("extra key", "keys"),
        ("not json", "not JSON"),
        ("unknown gpu", "not visible"),
    ],
)
def test_bad_handle_rejected(child, case, err):
    from distserve.server.kv_transfer import KVStagingServer
    from distserve.server.kv_transfer.frame import FrameType

    fake = FakeSender()
    fake.text = {
        "random handle": _desc(),
        "expandable segment": _desc(handle=(bytes([2, ord("e")]) + os.urandom(64)).hex()),
        "outside storage": _desc(size=4096, off=0),
        "extra key": json.dumps({**json.loads(_desc()), "pid": 1}),
        "not json": "{not json",
        "unknown gpu": _desc(dev="GPU-00000000-0000-0000-0000-000000000000"),
    }[case]
    r = child.pull(fake.handle(f"bad-{case}"))
    assert r["status"] == "failed" and err in r["error"], r
    # the receiver sends ERROR then returns; the fake's thread reads that frame concurrently, so the
    # pull result can reach us before the fake has recorded the reply (seen on the two-GPU machine)
    _until(lambda: fake.replies)
    assert fake.replies and getattr(fake.replies[-1], "type", None) is FrameType.ERROR  # never ACK
    fake.listener.close()
    # the receiving process is still healthy: a real pull after the forged one works
    with KVStagingServer(cuda_ipc_pool_bytes=16 << 20) as srv:
        h = srv.stage("ok", _kv(seed=3), transport="cuda_ipc")
        r = child.pull(h)
        assert r["status"] == "success" and r["sha"] == _sha(_kv(seed=3))
