"""KV hand-off by reference: block ids and ownership cross from prefill to decode, not bytes.

On one device (one GPU, or one host on the CPU) the decode worker's KV pool is an exported arena
(``kv_arena.py``). The prefill worker maps it and writes a prompt's KV straight into blocks the
decode worker *leased* to it; the hand-off through the router then carries only the lease (block
ids), and the decode worker adopts those blocks as the sequence's block table: nothing is copied
on the decode side, nothing is staged on the prefill side.

Ownership protocol (the blocks are always the decode worker's; a lease lends them for writing)::

    prefill (lessee)                         decode (lessor, owns the pool)
    HELLO token ─────────────────────────▶  check token → arena description (mapped by the lessee)
    LEASE rid, T tokens ─────────────────▶  ceil((T+1)/bs) blocks taken from its block manager
                         ◀── lease id, ids   lease LEASED (bound to this connection)
    write KV into the ids (own stream, wait)
    WRITTEN lease ───────────────────────▶  lease WRITTEN, deadline = now + lease_ms
    handle {lease, ids} ──▶ router ──▶ /internal/generate: ADOPT (ids, rid, arena id checked)
                                            blocks become the sequence's; the lease is gone;
                                            they go back to the free list when it finishes

    and on the way, any of:
    RELEASE lease (prefill failed or was aborted before the hand-off) → blocks freed
    /internal/abort rid on decode                                     → its WRITTEN lease freed
    WRITTEN lease past its deadline (hand-off never came)             → freed (sweeper)
    lessee connection closed (prefill killed, or it gave up on us)    → its LEASED leases freed once
                                                                         its process (pid in HELLO) is
                                                                         gone, at once when it is; while
                                                                         it lives (a reset connection) it
                                                                         may still be writing: held to
                                                                         the deadline. WRITTEN ones wait
                                                                         for their hand-off or deadline
    decode killed                                                      → its pool goes with it; the
                                                                         lessee's connection breaks,
                                                                         it drops the mapping and the
                                                                         request falls back to the copy
                                                                         path; streams migrate as usual

A LEASED lease is never freed while its connection is open, however long it takes: the lessee may
still be writing into it, and a block reused under a late write would corrupt another sequence. A connection
that closes while the lessee's process lives (reset on the way: the lessee cannot tell us its writes are done)
leaves its LEASED leases *orphaned*: freed when that process exits or at ``lease_ms``, whichever comes first.

Wire: each message is a 4-byte big-endian length and a JSON object of at most ``MAX_MESSAGE``
bytes; every field is checked (exact key sets, ints in range, block ids unique and inside the
pool); nothing is pickled. The first message of a connection must be HELLO with the internal
token within ``handshake_timeout_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import re
import secrets
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from .base import parse_address
from .kv_arena import ArenaDescription, ArenaError, ArenaLayout, ArenaMapping

log = logging.getLogger(__name__)

MAX_MESSAGE = 1 << 20
MAX_BLOCKS = 1 << 18
_LEN = struct.Struct(">I")
_ID = re.compile(r"[0-9a-f]{32}")
TRANSPORT = "reference"
BY_REFERENCE_MODES = ("off", "auto", "on")


class RefError(ValueError):
    """A by-reference message or hand-off that is malformed or refers to no live lease."""


# ------------------------------------------------------------------ framing
async def read_message(reader: asyncio.StreamReader) -> dict[str, Any]:
    head = await reader.readexactly(_LEN.size)
    (n,) = _LEN.unpack(head)
    if not 2 <= n <= MAX_MESSAGE:
        raise RefError(f"by-reference message of {n} bytes (at most {MAX_MESSAGE})")
    body = await reader.readexactly(n)
    try:
        msg = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise RefError("by-reference message is not JSON") from None
    if not isinstance(msg, dict):
        raise RefError("by-reference message is not a JSON object")
    return msg


def encode_message(msg: dict[str, Any]) -> bytes:
    body = json.dumps(msg, separators=(",", ":")).encode()
    if len(body) > MAX_MESSAGE:
        raise RefError(f"by-reference message of {len(body)} bytes is too large")
    return _LEN.pack(len(body)) + body


def _int(msg: dict, key: str, lo: int, hi: int) -> int:
    v = msg.get(key)
    if type(v) is not int or not lo <= v <= hi:
        raise RefError(f"by-reference field {key!r} must be an int in [{lo}, {hi}], got {v!r}")
    return v


def _str(msg: dict, key: str, max_len: int = 256) -> str:
    v = msg.get(key)
    if not isinstance(v, str) or not 1 <= len(v) <= max_len:
        raise RefError(f"by-reference field {key!r} must be a string of 1..{max_len} chars")
    return v


def _lease_id(msg: dict, key: str = "lease_id") -> str:
    v = msg.get(key)
    if not isinstance(v, str) or not _ID.fullmatch(v):
        raise RefError(f"by-reference field {key!r} must be 32 lowercase hex digits")
    return v


def check_block_ids(ids: Any, num_blocks: int, expected: int | None = None) -> list[int]:
    if not isinstance(ids, list) or not 1 <= len(ids) <= MAX_BLOCKS:
        raise RefError(f"block_ids must be a list of 1..{MAX_BLOCKS} ints")
    for b in ids:
        if type(b) is not int or not 0 <= b < num_blocks:
            raise RefError(f"block id {b!r} outside the pool [0, {num_blocks})")
    if len(set(ids)) != len(ids):
        raise RefError("block_ids repeat a block")
    if expected is not None and len(ids) != expected:
        raise RefError(f"{len(ids)} block ids, expected {expected}")
    return ids


def process_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process of this host (a zombie is not: its writes are over)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: it exists
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:  # no /proc: trust kill
        return True
    end = stat.rfind(b")")  # "pid (comm) S ...": comm may hold spaces and parentheses
    return stat[end + 2 : end + 3] != b"Z"


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks a lease for a KV of ``num_tokens`` holds: the KV and the slot of the next token."""
    return -(-(num_tokens + 1) // block_size)


# ------------------------------------------------------------------ the hand-off through the router
@dataclass(frozen=True)
class RefHandle:
    """``PrefillResponse.kv`` / ``GenerateRequest.kv`` when the KV went by reference."""

    request_id: str
    arena_id: str
    lease_id: str
    num_tokens: int  # KV tokens written (every token but the newest)
    block_ids: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "transport": TRANSPORT,
            "request_id": self.request_id,
            "arena_id": self.arena_id,
            "lease_id": self.lease_id,
            "num_tokens": self.num_tokens,
            "block_ids": list(self.block_ids),
        }

    @classmethod
    def from_dict(cls, d: Any) -> RefHandle:
        keys = {"transport", "request_id", "arena_id", "lease_id", "num_tokens", "block_ids"}
        if not isinstance(d, dict) or set(d) != keys or d.get("transport") != TRANSPORT:
            raise RefError(f"a by-reference KV handle has exactly the keys {sorted(keys)}")
        ids = check_block_ids(d["block_ids"], 1 << 32)
        return cls(
            request_id=_str(d, "request_id"),
            arena_id=_lease_id(d, "arena_id"),
            lease_id=_lease_id(d),
            num_tokens=_int(d, "num_tokens", 1, 1 << 31),
            block_ids=tuple(ids),
        )


def is_reference(kv: Any) -> bool:
    return isinstance(kv, dict) and kv.get("transport") == TRANSPORT


# ------------------------------------------------------------------ decode side: the lessor
@dataclass
class Lease:
    lease_id: str
    request_id: str
    num_tokens: int
    block_ids: list[int]
    conn: int  # the lessee connection it was granted on
    state: str = "leased"  # leased -> written -> (adopted | freed); leased -> orphaned -> freed
    deadline: float = 0.0
    writer_pid: int | None = None  # the lessee's process (its HELLO), None when it did not say


@dataclass
class LessorStats:
    granted: int = 0
    refused: int = 0
    adopted: int = 0
    released: int = 0  # RELEASE from the lessee
    aborted: int = 0  # /internal/abort on the decode worker
    expired: int = 0  # written, hand-off never came
    reclaimed: int = 0  # leased, lessee connection closed

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class BlockSource:
    """How the lessor takes and gives back blocks of the owner's pool (on the engine's thread)."""

    take: Callable[[int], Awaitable[list[int] | None]]  # n blocks or None (no room)
    give_back: Callable[[list[int]], Awaitable[None]]


class KVLessor:
    """Decode side. ``start()`` listens; leases live in ``leases`` until adopted or freed."""

    def __init__(
        self,
        host: str,
        token: str,
        description: ArenaDescription,
        blocks: BlockSource,
        *,
        lease_ms: float = 30_000,
        handshake_timeout_s: float = 2.0,
        max_connections: int = 64,
    ) -> None:
        self.host = host
        self._token = token.encode()
        self.description = description
        self.blocks = blocks
        self.lease_s = lease_ms / 1000.0
        self.handshake_timeout_s = handshake_timeout_s
        self.max_connections = max_connections
        self.leases: dict[str, Lease] = {}
        self.stats = LessorStats()
        self._server: asyncio.base_events.Server | None = None
        self._sweeper: asyncio.Task | None = None
        self._conns = 0
        self._next_conn = 0
        self.address = ""

    @property
    def block_size(self) -> int:
        return self.description.layout.block_size

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, self.host, 0)
        port = self._server.sockets[0].getsockname()[1]
        self.address = f"{self.host}:{port}" if ":" not in self.host else f"[{self.host}]:{port}"
        self._sweeper = asyncio.create_task(self._sweep(), name="kv-lease-sweeper")
        return self.address

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)

    @property
    def num_leased_blocks(self) -> int:
        return sum(len(lease.block_ids) for lease in self.leases.values())

    async def _free(self, lease: Lease, why: str) -> None:
        if self.leases.pop(lease.lease_id, None) is None:
            return
        setattr(self.stats, why, getattr(self.stats, why) + 1)
        await self.blocks.give_back(lease.block_ids)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(min(0.5, self.lease_s / 4))
            now = time.monotonic()
            for lease in [x for x in self.leases.values() if x.state == "written" and x.deadline <= now]:
                log.warning("KV lease of %s expired before its hand-off: blocks freed", lease.request_id)
                await self._free(lease, "expired")
            for lease in [x for x in self.leases.values() if x.state == "orphaned"]:
                if lease.deadline <= now or lease.writer_pid is None or not process_alive(lease.writer_pid):
                    await self._free(lease, "reclaimed")

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._conns >= self.max_connections:
            writer.close()
            return
        self._conns += 1
        self._next_conn += 1
        conn = self._next_conn
        lock = asyncio.Lock()
        tasks: set[asyncio.Task] = set()

        async def reply(msg: dict) -> None:
            async with lock:
                writer.write(encode_message(msg))
                await writer.drain()

        try:
            hello = await asyncio.wait_for(read_message(reader), self.handshake_timeout_s)
            got = hello.get("token")
            if (
                hello.get("op") != "hello"
                or not isinstance(got, str)
                or not hmac.compare_digest(got.encode(), self._token)
            ):
                await reply({"seq": 0, "ok": False, "error": "auth"})
                return
            pid = hello.get("pid")
            writer_pid = pid if type(pid) is int and 0 < pid < 1 << 31 else None
            await reply({"seq": 0, "ok": True, "arena": self.description.to_dict()})
            while True:
                msg = await read_message(reader)
                task = asyncio.create_task(self._handle(conn, msg, reply, writer_pid))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError, RefError, OSError):
            pass
        finally:
            self._conns -= 1
            for t in list(tasks):
                with contextlib.suppress(BaseException):
                    await t
            # the connection is gone: its LEASED blocks are free once nobody writes them. A writer whose process
            # lives (the connection was reset, not the process killed) may still be writing: orphaned until it
            # exits or the lease deadline, never lent again under a late write.
            deadline = time.monotonic() + self.lease_s
            for lease in [x for x in self.leases.values() if x.conn == conn and x.state == "leased"]:
                if lease.writer_pid is not None and process_alive(lease.writer_pid):
                    lease.state, lease.deadline = "orphaned", deadline
                    log.warning(
                        "KV lease of %s: its lessee's connection closed while its process lives; blocks held until "
                        "it exits or %.0f s",
                        lease.request_id,
                        self.lease_s,
                    )
                else:
                    await self._free(lease, "reclaimed")
            writer.close()

    async def _handle(self, conn: int, msg: dict, reply, writer_pid: int | None = None) -> None:
        seq = msg.get("seq")
        if type(seq) is not int or not 1 <= seq < 1 << 62:
            seq = -1
        try:
            out = await self._op(conn, msg, writer_pid)
        except RefError as e:
            out = {"ok": False, "error": str(e)}
        with contextlib.suppress(ConnectionError, OSError):
            await reply({"seq": seq, **out})

    async def _op(self, conn: int, msg: dict, writer_pid: int | None = None) -> dict:
        op = msg.get("op")
        if op == "lease":
            rid = _str(msg, "request_id")
            n = _int(msg, "num_tokens", 1, 1 << 31)
            want = blocks_for(n, self.block_size)
            if want > self.description.layout.num_blocks:
                raise RefError(f"a KV of {n} tokens does not fit the pool")
            ids = await self.blocks.take(want)
            if ids is None:
                self.stats.refused += 1
                return {"ok": False, "error": "no room"}
            lease = Lease(secrets.token_hex(16), rid, n, list(ids), conn, writer_pid=writer_pid)
            self.leases[lease.lease_id] = lease
            self.stats.granted += 1
            return {"ok": True, "lease_id": lease.lease_id, "block_ids": lease.block_ids}
        if op == "written":
            w = self.leases.get(_lease_id(msg))
            if w is None or w.conn != conn or w.state != "leased":
                raise RefError("no such lease being written")
            w.state, w.deadline = "written", time.monotonic() + self.lease_s
            return {"ok": True}
        if op == "release":
            r = self.leases.get(_lease_id(msg))
            if r is None:
                return {"ok": True, "released": False}  # adopted, expired or freed already
            if r.conn != conn and r.state in ("leased", "orphaned"):
                raise RefError("a lease being written is released by its writer only")
            await self._free(r, "released")
            return {"ok": True, "released": True}
        raise RefError(f"unknown by-reference op {op!r}")

    # --- the hand-off (decode worker's /internal/generate and /internal/abort) ---
    def claim(self, handle: RefHandle) -> Lease:
        """Check a hand-off against its lease and take the lease out (the caller adopts or frees its
        blocks). RefError when it is not a live, written lease of this request in this arena."""
        if handle.arena_id != self.description.arena_id:
            raise RefError("the KV handle names another KV pool (the decode worker restarted?)")
        lease = self.leases.get(handle.lease_id)
        if lease is None:
            raise RefError("the KV lease expired or was released")
        if lease.request_id != handle.request_id or lease.state != "written":
            raise RefError("the KV lease belongs to another request or is not written yet")
        if list(handle.block_ids) != lease.block_ids or handle.num_tokens != lease.num_tokens:
            raise RefError("the KV handle's block ids or token count differ from its lease")
        del self.leases[lease.lease_id]
        self.stats.adopted += 1
        return lease

    async def give_back(self, lease: Lease) -> None:
        """Blocks of a claimed lease the engine did not adopt (e.g. the commit failed)."""
        await self.blocks.give_back(lease.block_ids)

    async def abort_request(self, request_id: str) -> int:
        """Free the written leases of an aborted request (leased ones are its writer's to release)."""
        gone = [x for x in self.leases.values() if x.request_id == request_id and x.state == "written"]
        for lease in gone:
            await self._free(lease, "aborted")
        return len(gone)


# ------------------------------------------------------------------ prefill side: the lessee
class _Peer:
    """One decode worker's lessor: a persistent connection (multiplexed by ``seq``) and its mapped pool."""

    def __init__(self, address: str, reader, writer, mapping: ArenaMapping) -> None:
        self.address = address
        self.reader, self.writer, self.mapping = reader, writer, mapping
        self.pending: dict[int, asyncio.Future] = {}
        self.abandoned: set[int] = set()  # calls whose caller gave up (cancelled, timed out) before the reply
        self.seq = 0
        self.closed = False
        self.lock = asyncio.Lock()
        self.reader_task = asyncio.create_task(self._read(), name=f"kv-lessee-{address}")

    async def _read(self) -> None:
        try:
            while True:
                msg = await read_message(self.reader)
                seq = msg.get("seq")
                fut = self.pending.pop(seq, None) if type(seq) is int else None
                if fut is not None and not fut.done():
                    fut.set_result(msg)
                elif seq in self.abandoned:
                    self.abandoned.discard(seq)
                    lease_id = msg.get("lease_id")
                    if msg.get("ok") is True and isinstance(lease_id, str) and _ID.fullmatch(lease_id):
                        # a lease granted to a caller that gave up: nobody writes it, give it back now
                        asyncio.ensure_future(self._give_back(lease_id))
        except (asyncio.IncompleteReadError, ConnectionError, RefError, OSError):
            pass
        finally:
            self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(ConnectionError("the decode worker's lessor went away"))
        self.pending.clear()
        self.writer.close()
        self.mapping.close()  # its writes are done or failed: nothing writes into a dead pool later

    async def _give_back(self, lease_id: str) -> None:
        with contextlib.suppress(ConnectionError, TimeoutError, OSError, RefError):
            await self.call({"op": "release", "lease_id": lease_id}, 10.0)

    async def call(self, msg: dict, timeout_s: float) -> dict:
        if self.closed:
            raise ConnectionError("the decode worker's lessor went away")
        self.seq += 1
        seq = self.seq
        fut = asyncio.get_running_loop().create_future()
        self.pending[seq] = fut
        try:
            async with self.lock:
                self.writer.write(encode_message({"seq": seq, **msg}))
                await self.writer.drain()
            return await asyncio.wait_for(fut, timeout_s)
        except BaseException:
            if self.pending.pop(seq, None) is not None:
                self.abandoned.add(seq)  # its reply, when it comes, is handled by _read
            raise


@dataclass
class LesseeStats:
    handed_off: int = 0
    fell_back: int = 0  # a lease refused or a peer unusable: the copy path ran
    released: int = 0
    room_waits: int = 0  # leases that waited for room in the decode worker's pool (``room_wait_s``)

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class _Held:
    peer: _Peer
    lease_id: str
    until: float


class KVLessee:
    """Prefill side: peers by address; ``lease`` → write (``ArenaMapping.write``) → ``written``."""

    def __init__(
        self,
        token: str,
        local: ArenaLayout,
        device,
        *,
        timeout_s: float = 10.0,
        lease_ms: float = 30_000,
        room_wait_s: float = 0.0,
        on_room_wait: Callable[[], object] | None = None,
    ) -> None:
        self._token = token
        self.local = local
        self.device = device
        self.timeout_s = timeout_s
        self.lease_s = lease_ms / 1000.0
        # A lease the decode worker refuses for want of room is asked again (backing off) for up to this long:
        # the copy path's wait for room (``reserve``), by reference. 0: refused at once (the caller copies).
        self.room_wait_s = room_wait_s
        self.waiting_for_room = 0  # leases waiting for room now (the prefill answer's proof of progress)
        self._on_room_wait = on_room_wait  # called once per lease that waits (a metric)
        self._leasing: set[str] = set()  # requests inside ``lease`` now
        self._abandoned: set[str] = set()  # ... of which no longer wanted
        self._peers: dict[str, _Peer] = {}
        self._connecting: dict[str, asyncio.Lock] = {}
        self.held: dict[str, _Held] = {}  # request id -> its lease until handed off (for abort)
        self.stats = LesseeStats()
        self.unusable: dict[str, str] = {}  # address -> why (logged once)

    async def peer(self, address: str) -> _Peer:
        p = self._peers.get(address)
        if p is not None and not p.closed:
            return p
        lock = self._connecting.setdefault(address, asyncio.Lock())
        async with lock:
            p = self._peers.get(address)
            if p is not None and not p.closed:
                return p
            host, port = parse_address(address)
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), self.timeout_s)
            try:
                # our pid: a lessor that loses this connection holds what we may still be writing while we live
                writer.write(encode_message({"op": "hello", "token": self._token, "pid": os.getpid()}))
                await writer.drain()
                hello = await asyncio.wait_for(read_message(reader), self.timeout_s)
                if hello.get("ok") is not True:
                    raise RefError(f"the decode worker's lessor refused: {hello.get('error')}")
                desc = ArenaDescription.from_dict(hello.get("arena"))
                mapping = await asyncio.to_thread(ArenaMapping, desc, self.local, self.device)
            except BaseException:
                writer.close()
                raise
            p = self._peers[address] = _Peer(address, reader, writer, mapping)
            log.info("mapped the KV pool of the decode worker at %s (%s)", address, desc.kind)
            return p

    async def lease(self, address: str, request_id: str, num_tokens: int) -> tuple[_Peer, str, list[int]]:
        """Blocks for ``num_tokens`` in the decode worker's pool; a refusal for want of room is asked again
        every 5-100 ms for up to ``room_wait_s`` (blocks free as its sequences finish), unless ``abandon``ed."""
        p = await self.peer(address)
        deadline, delay, waited = time.monotonic() + self.room_wait_s, 0.005, False
        self._leasing.add(request_id)
        try:
            while True:
                msg = {"op": "lease", "request_id": request_id, "num_tokens": num_tokens}
                r = await p.call(msg, self.timeout_s)
                if r.get("ok") is True:
                    break
                if r.get("error") != "no room" or request_id in self._abandoned or time.monotonic() >= deadline:
                    raise RefError(f"lease refused: {r.get('error')}" + (" (after waiting for room)" if waited else ""))
                if not waited:
                    waited = True
                    self.stats.room_waits += 1
                    if self._on_room_wait is not None:
                        self._on_room_wait()
                self.waiting_for_room += 1
                try:
                    await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                finally:
                    self.waiting_for_room -= 1
                delay = min(delay * 2, 0.1)
        finally:
            self._leasing.discard(request_id)
            self._abandoned.discard(request_id)
        lease_id = _lease_id(r)
        layout = p.mapping.description.layout
        try:
            ids = check_block_ids(r.get("block_ids"), layout.num_blocks, blocks_for(num_tokens, layout.block_size))
        except RefError:  # a grant we will not write into: give it back, or it stays leased while we are connected
            await p._give_back(lease_id)
            raise
        self.held[request_id] = _Held(p, lease_id, time.monotonic() + self.lease_s)
        return p, lease_id, ids

    def abandon(self, request_id: str) -> None:
        """This request's lease, if it is being asked for, is not wanted any more: stop asking."""
        if request_id in self._leasing:
            self._abandoned.add(request_id)

    async def written(self, p: _Peer, lease_id: str) -> None:
        r = await p.call({"op": "written", "lease_id": lease_id}, self.timeout_s)
        if r.get("ok") is not True:
            raise RefError(f"written refused: {r.get('error')}")

    async def release(self, request_id: str) -> bool:
        """Give a request's lease back (its prefill failed, or it was aborted before the hand-off)."""
        held = self.held.pop(request_id, None)
        self._forget_old()
        if held is None or held.peer.closed:
            return False
        try:
            r = await held.peer.call({"op": "release", "lease_id": held.lease_id}, self.timeout_s)
        except (ConnectionError, TimeoutError, OSError):
            return False  # the lessor is gone (its pool too) or will free it at the deadline
        self.stats.released += 1
        return bool(r.get("released"))

    def _forget_old(self) -> None:
        now = time.monotonic()
        for rid in [r for r, h in self.held.items() if h.until <= now]:
            del self.held[rid]  # past the lease: adopted or freed by the lessor by now

    async def close(self) -> None:
        for p in list(self._peers.values()):
            p.close()
            with contextlib.suppress(BaseException):
                await p.reader_task
        self._peers.clear()


@dataclass
class HandOff:
    """What the prefill side needs to hand one request's KV over by reference."""

    handle: RefHandle
    seconds: float = 0.0
    notes: dict = field(default_factory=dict)


async def _release_after(lessee: KVLessee, request_id: str, leased: Awaitable) -> None:
    with contextlib.suppress(BaseException):
        await leased
    await lessee.release(request_id)


async def hand_off(
    lessee: KVLessee,
    address: str,
    request_id: str,
    kv,
    write: Callable[[ArenaMapping, list[int]], Awaitable[None]],
    leased: Awaitable[tuple[_Peer, str, list[int]]] | None = None,
) -> HandOff:
    """lease → write → written; on any failure the lease is released and the error raised (the caller
    falls back to the copy path). ``write`` puts ``kv`` into the leased blocks and returns once done.
    ``leased``: a ``lessee.lease`` for this request started earlier (while the prompt was prefilled), so its
    round trip is off the path to the first token."""
    t0 = time.perf_counter()
    num_tokens = int(kv.shape[2])
    if leased is None:
        p, lease_id, ids = await lessee.lease(address, request_id, num_tokens)
    else:
        try:
            p, lease_id, ids = await asyncio.shield(leased)
        except asyncio.CancelledError:  # the lease may still be granted: give it back once it is
            asyncio.ensure_future(_release_after(lessee, request_id, leased))
            raise
        if len(ids) != blocks_for(num_tokens, p.mapping.description.layout.block_size):
            await lessee.release(request_id)
            raise RefError(f"the lease holds {len(ids)} blocks, the KV of {num_tokens} tokens needs another count")
    writing = asyncio.ensure_future(write(p.mapping, ids[: -(-num_tokens // p.mapping.description.layout.block_size)]))
    try:
        await asyncio.shield(writing)
        await lessee.written(p, lease_id)
    except BaseException:
        # never give blocks back while a write into them may still land (a cancelled caller included)
        while not writing.done():
            with contextlib.suppress(BaseException):
                await asyncio.shield(writing)
        await lessee.release(request_id)
        raise
    lessee.stats.handed_off += 1
    handle = RefHandle(request_id, p.mapping.arena_id, lease_id, num_tokens, tuple(ids))
    return HandOff(handle, time.perf_counter() - t0)


__all__ = [
    "BY_REFERENCE_MODES",
    "ArenaError",
    "BlockSource",
    "HandOff",
    "KVLessee",
    "KVLessor",
    "Lease",
    "RefError",
    "RefHandle",
    "hand_off",
    "is_reference",
]
