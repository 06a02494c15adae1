"""What of cuda_ipc, per-worker devices and preset serving can be checked without a GPU:
description parsing (everything a receiver validates before it opens anything), the frame type,
the staging server's argument checks, the launcher's device assignment, the router's tokenizer
for shape presets. The GPU half is tests/gpu/test_cuda_ipc.py."""

from __future__ import annotations

import json

import pytest
import torch

from distserve.server.kv_transfer import KVHandle, KVStagingServer
from distserve.server.kv_transfer import frame as fr
from distserve.server.kv_transfer.cuda_ipc import IpcDescription, IpcError, check_handle, parse_description

NBYTES = 4096
HANDLE = bytes([2, ord("c")]) + bytes(range(64))


def _text(**over) -> str:
    d = {
        "v": 1,
        "pool": "ab" * 16,
        "dev": "GPU-1234abcd-0000",
        "handle": HANDLE.hex(),
        "size": 1 << 20,
        "soff": 512,
        "off": 8192,
        "event": bytes(64).hex(),
        "sync": True,
    }
    d.update(over)
    return json.dumps(d)


def test_description_round_trip():
    desc = IpcDescription(
        pool="ab" * 16,
        device_uuid="GPU-1234abcd-0000",
        handle=HANDLE,
        storage_bytes=1 << 20,
        storage_offset=512,
        offset=8192,
        event=bytes(64),
        event_sync=True,
    )
    assert parse_description(desc.to_text(), NBYTES) == desc
    assert parse_description(_text(), NBYTES) == desc
    assert len(desc.to_text()) < fr.MAX_TEXT_BYTES
    legacy = parse_description(_text(handle=bytes(64).hex(), pool=""), NBYTES)
    assert legacy.handle == bytes(64) and legacy.pool == ""


@pytest.mark.parametrize(
    "text,match",
    [
        (_text(handle=(bytes([2, ord("e")]) + bytes(64)).hex()), "not a plain cudaMalloc"),
        (_text(handle=(bytes([0, ord("c")]) + bytes(64)).hex()), "not a plain cudaMalloc"),
        (_text(handle=(bytes([2, ord("c")]) + bytes(63)).hex()), "not a plain cudaMalloc"),
        (_text(handle=bytes(65).hex()), "not a plain cudaMalloc"),
        (_text(handle=bytes(131).hex()), "handle"),
        (_text(handle="AB" * 66), "handle"),
        (_text(handle="zz" * 66), "handle"),
        (_text(event=bytes(63).hex()), "event"),
        (_text(size=NBYTES - 1, off=0), "outside"),
        (_text(size=1 << 20, off=(1 << 20) - NBYTES + 1), "outside"),
        (_text(off=-1), "'off'"),
        (_text(size=True), "'size'"),
        (_text(size=1.5), "'size'"),
        (_text(size=1 << 50), "'size'"),
        (_text(sync=1), "'sync'"),
        (_text(v=2), "version"),
        (_text(v=True), "version"),
        (_text(pool="xyz"), "'pool'"),
        (_text(dev="../../etc"), "'dev'"),
        (_text(dev=7), "'dev'"),
        (json.dumps({**json.loads(_text()), "pid": 123}), "keys"),
        (json.dumps({k: v for k, v in json.loads(_text()).items() if k != "event"}), "keys"),
        ("[1, 2]", "keys"),
        ("{nope", "not JSON"),
        ("x" * 2000, "too long"),
    ],
)
def test_description_rejects(text, match):
    with pytest.raises(IpcError, match=match):
        parse_description(text, NBYTES)


def test_check_handle():
    check_handle(bytes(64))
    check_handle(HANDLE)
    check_handle(bytes([3, ord("c")]) + bytes(64))
    for bad in (b"", bytes(66), bytes([2, ord("e")]) + bytes(64), bytes(128), bytes([2, ord("c")]) + bytes(200)):
        with pytest.raises(IpcError):
            check_handle(bad)


def test_frame_type_carries_description():
    text = _text()
    raw = fr.encode_frame(
        fr.Frame(
            fr.FrameType.DATA_CUDA_IPC, request_id="r", dtype=torch.bfloat16, shape=(2, 1024), nbytes=NBYTES, text=text
        )
    )
    f = fr.decode_frame(raw)
    assert f.type is fr.FrameType.DATA_CUDA_IPC and f.text == text and f.nbytes == NBYTES
    bad = fr.encode_frame(
        fr.Frame(
            fr.FrameType.DATA_CUDA_IPC,
            request_id="r",
            dtype=torch.bfloat16,
            shape=(2, 1024),
            nbytes=NBYTES + 2,
            text=text,
        )
    )
    with pytest.raises(fr.FrameError, match="nbytes"):
        fr.decode_frame(bad)


def test_handle_accepts_cuda_ipc_and_staging_checks_device():
    d = {
        "request_id": "r",
        "transport": "cuda_ipc",
        "address": "127.0.0.1:9",
        "secret": "ab" * 16,
        "nbytes": 8,
        "shape": [2, 2],
        "dtype": "float16",
        "checksum": None,
        "host_id": "h",
    }
    assert KVHandle.from_dict(d).transport == "cuda_ipc"
    with KVStagingServer() as srv:
        with pytest.raises(ValueError, match="CUDA"):
            srv.stage("r", torch.zeros(4), transport="cuda_ipc")
        with pytest.raises(ValueError, match="transport must be"):
            srv.stage("r", torch.zeros(4), transport="rdma")


def test_cuda_ipc_refused_at_worker_start_on_cpu():
    from distserve.server.kv_transfer.factory import choose_transport

    with pytest.raises(ValueError, match="CUDA"):
        choose_transport("cuda_ipc", 0, True, 0.0, kv_on_cuda=False)


# ------------------------------------------------------------------ launcher devices
def test_parse_devices():
    from distserve.server.launcher import parse_devices

    assert parse_devices("cuda:0,cuda:1") == ("cuda:0", "cuda:1")
    assert parse_devices("cpu") == ("cpu",)
    assert parse_devices("cuda, cuda:3") == ("cuda", "cuda:3")
    for bad in ("gpu0", "cuda:", "cuda:x", "", "cpu,,cpu"):
        with pytest.raises(ValueError):
            parse_devices(bad)


@pytest.mark.parametrize(
    "mode,p,d,devices,want",
    [
        ("disaggregated", 1, 1, ("cuda:0", "cuda:1"), ["prefill-0=cuda:0", "decode-1=cuda:1"]),
        ("colocated", 1, 2, ("cuda:0", "cuda:1"), ["colocated-0=cuda:0", "colocated-1=cuda:1"]),
        (
            "disaggregated",
            2,
            2,
            ("cuda:0", "cuda:1"),
            ["prefill-0=cuda:0", "prefill-1=cuda:1", "decode-2=cuda:0", "decode-3=cuda:1"],
        ),
        ("disaggregated", 1, 1, (), ["prefill-0=cuda", "decode-1=cuda"]),
    ],
)
def test_launcher_assigns_devices_round_robin(mode, p, d, devices, want):
    from distserve.server.launcher import plan_workers

    got = [f"{wid}={dev}" for _, wid, dev in plan_workers(mode, p, d, "cuda", devices)]
    assert got == want


# ------------------------------------------------------------------ router tokenizer for presets
def test_router_tokenizer_for_presets():
    from distserve.server.config import load_config
    from distserve.server.router.app import RouterState
    from distserve.server.router.pipeline import NoWorkersError
    from distserve.server.router.registry import WorkerRegistry
    from distserve.server.wire import RegisterRequest

    reg = WorkerRegistry(3.0)
    state = RouterState(config=load_config(), token="t", registry=reg, model_path="preset:llama-2-7b")
    assert state.get_tokenizer().kind == "byte"
    state = RouterState(config=load_config(), token="t", registry=reg)
    with pytest.raises(NoWorkersError):
        state.get_tokenizer()  # nobody registered yet: 503, as before
    reg.register(
        RegisterRequest(
            worker_id="w",
            role="colocated",
            url="http://x",
            pid=1,
            fingerprint={},
            model_path=None,
            max_model_len=64,
            cuda_uuids=["GPU-1"],
        )
    )
    assert reg.workers["w"].cuda_uuids == ["GPU-1"]
    assert state.get_tokenizer().kind == "byte"
