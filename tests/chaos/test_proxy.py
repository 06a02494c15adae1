"""The userspace TCP proxy's toxics on loopback (no root needed)."""

from __future__ import annotations

import asyncio

import pytest

from distserve.chaos.proxy import serve, validate_toxic


async def _echo_server():
    async def handle(r, w):
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
        w.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    return srv, srv.sockets[0].getsockname()[1]


async def _through_proxy(toxics: list[dict], payload: bytes, tmp_path) -> tuple[bytes, int, str | None]:
    srv, port = await _echo_server()
    ready = tmp_path / "ready.json"
    task = asyncio.create_task(serve(("127.0.0.1", 0), ("127.0.0.1", port), toxics, str(ready)))
    while not ready.exists():
        await asyncio.sleep(0.01)
    import json

    pport = json.loads(ready.read_text())["port"]
    r, w = await asyncio.open_connection("127.0.0.1", pport)
    w.write(payload)
    await w.drain()
    got, reads, err = b"", 0, None
    try:
        while len(got) < len(payload):
            chunk = await asyncio.wait_for(r.read(65536), 10)
            if not chunk:
                break
            got += chunk
            reads += 1
    except (ConnectionError, OSError) as e:
        err = type(e).__name__
    w.close()
    task.cancel()
    srv.close()
    return got, reads, err


def test_slicer_delivers_every_byte_in_many_pieces(tmp_path):
    payload = bytes(range(256)) * 40
    got, reads, _ = asyncio.run(
        _through_proxy([{"type": "slicer", "average_size": 7, "size_variation": 3, "delay": 200}], payload, tmp_path)
    )
    assert got == payload and reads > 10


def test_limit_data_closes_after_n_bytes(tmp_path):
    got, _, _ = asyncio.run(_through_proxy([{"type": "limit_data", "bytes": 100}], b"x" * 1000, tmp_path))
    assert got == b"x" * 100


def test_reset_peer_resets(tmp_path):
    got, _, err = asyncio.run(_through_proxy([{"type": "reset_peer", "timeout": 0}], b"x" * 10, tmp_path))
    assert got == b"" or err is not None


def test_latency_still_delivers(tmp_path):
    got, _, _ = asyncio.run(_through_proxy([{"type": "latency", "latency": 20, "jitter": 5}], b"abc", tmp_path))
    assert got == b"abc"


def test_bad_toxics_are_refused_by_name():
    with pytest.raises(ValueError, match="unknown"):
        validate_toxic({"type": "teleport"})
    with pytest.raises(ValueError, match="rate must be a number"):
        validate_toxic({"type": "bandwidth", "rate": "fast"})
