"""A small userspace TCP proxy with toxiproxy's toxics, for kernels without ``sch_netem``.

``python -m distserve.chaos.proxy --listen 10.0.0.1:0 --upstream 10.0.0.1:5555 --toxic
'{"type": "latency", "latency": 50, "jitter": 10}' --ready-file F`` forwards every
connection to the upstream and applies the toxics to the bytes flowing
``downstream`` (upstream → client, the KV payload direction) unless a toxic says
``"stream": "upstream"``. Toxics (toxiproxy's names and units):

- ``latency``: ``latency`` ms (+ uniform ``jitter`` ms) before each chunk is forwarded
- ``bandwidth``: ``rate`` KB/s
- ``slicer``: chunks cut into ``average_size`` ± ``size_variation`` bytes, ``delay`` µs apart
- ``slow_close``: the close is delayed by ``delay`` ms
- ``timeout``: data stops; the connection is closed after ``timeout`` ms (0 = held open)
- ``reset_peer``: the connection is reset (RST) after ``timeout`` ms
- ``limit_data``: the connection is closed after ``bytes`` bytes

The same proxy between a client and the router (slicer) cuts SSE frames at odd
places, which tests stream parsing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import struct
import sys

from distserve.distbench.atomic import atomic_write

TOXICS = ("latency", "bandwidth", "slicer", "slow_close", "timeout", "reset_peer", "limit_data")


def validate_toxic(t: dict) -> dict:
    if t.get("type") not in TOXICS:
        raise ValueError(f"toxic type {t.get('type')!r} is unknown; known: {', '.join(TOXICS)}")
    if t.get("stream", "downstream") not in ("downstream", "upstream"):
        raise ValueError("toxic stream must be downstream or upstream")
    for k, v in t.items():
        if k not in ("type", "stream", "name") and (not isinstance(v, (int, float)) or v < 0):
            raise ValueError(f"toxic {t['type']}: {k} must be a number >= 0, got {v!r}")
    return t


def _reset(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:  # linger 0: close sends RST
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()


async def _pipe(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, toxics: list[dict], rng: random.Random
) -> None:
    sent = 0
    try:
        while True:
            data = await reader.read(65536)
            if not data:
                break
            for t in toxics:
                kind = t["type"]
                if kind == "latency":
                    await asyncio.sleep((t.get("latency", 0) + rng.uniform(0, t.get("jitter", 0))) / 1000.0)
                elif kind == "bandwidth" and t.get("rate", 0) > 0:
                    await asyncio.sleep(len(data) / (t["rate"] * 1024.0))
                elif kind == "timeout":
                    if t.get("timeout", 0) > 0:
                        await asyncio.sleep(t["timeout"] / 1000.0)
                        writer.close()
                    else:
                        await asyncio.Event().wait()  # held open, silent, until the proxy stops
                    return
                elif kind == "limit_data":
                    room = int(t.get("bytes", 0)) - sent
                    if room <= len(data):
                        writer.write(data[: max(0, room)])
                        await writer.drain()
                        writer.close()
                        return
            slicer = next((t for t in toxics if t["type"] == "slicer"), None)
            if slicer:
                avg, var = max(1, int(slicer.get("average_size", 1))), int(slicer.get("size_variation", 0))
                i = 0
                while i < len(data):
                    n = max(1, avg + rng.randint(-var, var))
                    writer.write(data[i : i + n])
                    await writer.drain()
                    i += n
                    await asyncio.sleep(slicer.get("delay", 0) / 1e6)
            else:
                writer.write(data)
                await writer.drain()
            sent += len(data)
    except (ConnectionError, OSError):
        pass
    finally:
        slow = next((t for t in toxics if t["type"] == "slow_close"), None)
        if slow:
            await asyncio.sleep(slow.get("delay", 0) / 1000.0)
        try:
            writer.close()
        except (ConnectionError, OSError):
            pass


async def _handle(client_r, client_w, upstream: tuple[str, int], toxics: list[dict], seed: int) -> None:
    try:
        up_r, up_w = await asyncio.open_connection(*upstream)
    except OSError:
        _reset(client_w)
        return
    rng = random.Random(seed)
    down = [t for t in toxics if t.get("stream", "downstream") == "downstream"]
    up = [t for t in toxics if t.get("stream") == "upstream"]
    tasks = [asyncio.create_task(_pipe(up_r, client_w, down, rng)), asyncio.create_task(_pipe(client_r, up_w, up, rng))]
    reset = next((t for t in toxics if t["type"] == "reset_peer"), None)
    if reset:
        await asyncio.sleep(reset.get("timeout", 0) / 1000.0)
        _reset(client_w)
        _reset(up_w)
        for t in tasks:
            t.cancel()
        return
    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    await asyncio.sleep(0)
    for w in (client_w, up_w):
        try:
            w.close()
        except (ConnectionError, OSError):
            pass
    await asyncio.gather(*tasks, return_exceptions=True)


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def _write_ready(path: str, info: dict) -> None:
    atomic_write(path, json.dumps(info))


async def serve(
    listen: tuple[str, int], upstream: tuple[str, int], toxics: list[dict], ready_file: str | None = None, seed: int = 0
) -> None:
    counter = iter(range(1 << 62))
    server = await asyncio.start_server(
        lambda r, w: _handle(r, w, upstream, toxics, seed + next(counter)), listen[0], listen[1]
    )
    port = server.sockets[0].getsockname()[1]
    if ready_file:
        _write_ready(ready_file, {"host": listen[0], "port": port, "pid": os.getpid()})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m distserve.chaos.proxy",
        description=__doc__.split("\n\n")[0] + " Example: "
        "python -m distserve.chaos.proxy --listen 127.0.0.1:0 --upstream 127.0.0.1:8080 "
        '--toxic \'{"type": "slicer", "average_size": 7}\'',
    )
    p.add_argument("--listen", type=_addr, required=True, help="HOST:PORT to listen on (port 0 = any)")
    p.add_argument("--upstream", type=_addr, required=True, help="HOST:PORT to forward to")
    p.add_argument("--toxic", action="append", default=[], help="a toxic as JSON (repeatable)")
    p.add_argument("--ready-file", default=None, help="write {host, port, pid} here once listening")
    p.add_argument("--seed", type=int, default=0, help="seed of jitter and slice sizes (default 0)")
    args = p.parse_args(argv)
    try:
        toxics = [validate_toxic(json.loads(t)) for t in args.toxic]
    except (ValueError, json.JSONDecodeError) as e:
        print(f"chaos.proxy: error: {e}", file=sys.stderr)
        return 2
    asyncio.run(serve(args.listen, args.upstream, toxics, args.ready_file, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
