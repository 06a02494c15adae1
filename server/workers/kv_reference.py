"""The workers' side of KV hand-off by reference (``server/kv_transfer/by_reference.py``).

``kv_transfer.by_reference``: ``off`` (the copy path only), ``auto`` (by reference when the decode
worker's pool can be mapped — same host on the CPU, the same GPU on CUDA — else the copy path, chosen
per request), ``on`` (by reference or the request fails: no silent copy; for tests and benchmarks).

Decode worker: its KV pool is an exported arena (``LLMEngine(kv_arena=...)``); a ``KVLessor`` lends
blocks of it, taken from and given back to the engine's block manager between steps. A hand-off
(``GenerateRequest.kv`` with transport ``reference``) is claimed from the lessor and adopted by the
engine: the leased blocks become the sequence's block table.

Prefill worker: a ``KVLessee`` maps each decode worker's arena once (``PrefillRequest.peer_kv_arena``
names its lessor) and, per request, leases blocks, writes the gathered KV into them on a side stream
(waiting for the write), reports it written, and answers with the lease instead of a staged copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import torch

from distserve.server.engine.sampling_params import SamplingParams
from distserve.server.kv_transfer import cuda_ipc
from distserve.server.kv_transfer.by_reference import BlockSource, KVLessee, KVLessor, RefError, RefHandle, hand_off
from distserve.server.kv_transfer.factory import host_id
from distserve.server.kv_transfer.kv_arena import ArenaError, ArenaMapping, layout_for

log = logging.getLogger(__name__)


def make_lessor(state, host: str) -> KVLessor | None:
    """The decode worker's lessor, when its engine's pool is an arena."""
    engine = state.loop.engine
    if engine.kv_arena is None:
        return None
    loop, bm = state.loop, engine.block_manager

    async def take(n: int) -> list[int] | None:
        return await loop.call(lambda: bm.take_blocks(n))

    async def give_back(blocks: list[int]) -> None:
        await loop.call(lambda: bm.give_back(blocks))

    kvc = state.config.kv_transfer
    return KVLessor(
        host,
        state.token,
        engine.kv_arena.description,
        BlockSource(take, give_back),
        lease_ms=kvc.lease_ms,
        handshake_timeout_s=kvc.handshake_timeout_ms / 1000.0,
        max_connections=kvc.max_connections,
    )


def make_lessee(state) -> KVLessee | None:
    """The prefill worker's lessee (None with ``by_reference: off`` or an FP8 cache: the two workers'
    FP8 scales differ, so its bytes cannot be adopted as they are)."""
    engine, kvc = state.loop.engine, state.config.kv_transfer
    if kvc.by_reference == "off" or engine.runner.kv_calibration is not None:
        return None
    local = layout_for(engine.model_config, 1, engine.config.block_size, engine.runner.kv_dtype)
    # ``on``: no copy to fall back to, so a lease the decode worker has no room for waits, as a copy waits for
    # room there (``reserve``, up to ``request_timeout_s``); ``auto`` copies at once and waits on that path
    wait_s = state.config.router.request_timeout_s if kvc.by_reference == "on" else 0.0
    return KVLessee(
        state.token,
        local,
        engine.device,
        timeout_s=kvc.pull_timeout_ms / 1000.0,
        lease_ms=kvc.lease_ms,
        room_wait_s=wait_s,
        on_room_wait=state.metrics.kv_reference_room_waits.inc,
    )


def _write_blocking(mapping: ArenaMapping, ids: list[int], kv: torch.Tensor, ready) -> None:
    if not kv.is_cuda:
        mapping.write(ids, kv)
        return
    stream = cuda_ipc.side_stream(kv.device)
    with torch.cuda.device(kv.device), torch.cuda.stream(stream):
        if ready is not None:
            stream.wait_event(ready)
        mapping.write(ids, kv)
        done = torch.cuda.Event()
        done.record(stream)
    done.synchronize()


def early_lease(state, body) -> asyncio.Task | None:
    """Lease the decode worker's blocks for this request while its prompt is prefilled (None: not by
    reference). The task is never cancelled: ``drop_lease`` gives an unused lease back once it is granted."""
    lessee: KVLessee | None = state.lessee
    address = body.peer_kv_arena
    if lessee is None or not address or address in lessee.unusable:
        return None
    if body.peer_host_id is not None and body.peer_host_id != host_id():
        return None
    n = len(body.prompt_token_ids) + len(body.output_token_ids)  # the KV: every token but token #1
    return asyncio.ensure_future(lessee.lease(address, body.request_id, n))


def drop_lease(state, rid: str, task: asyncio.Task | None) -> None:
    """An early lease the request will not use (it finished at token #1, failed, or went by copy)."""
    if task is None:
        return

    state.lessee.abandon(rid)  # a lease still waiting for room stops asking

    async def drop() -> None:
        with contextlib.suppress(BaseException):
            await task
        await state.lessee.release(rid)

    asyncio.ensure_future(drop())


async def prefill_by_reference(
    state, rid: str, kv: torch.Tensor, ready, address: str, leased: asyncio.Task | None = None
) -> dict | None:
    """The by-reference handle of this request's KV, or None to take the copy path (``auto``); with
    ``on`` a failure raises RefError (the request fails, saying why). ``leased``: its ``early_lease``."""
    lessee: KVLessee | None = state.lessee
    mode = state.config.kv_transfer.by_reference
    if lessee is None:
        return None
    why = lessee.unusable.get(address)
    if why is None:
        try:

            async def write(mapping: ArenaMapping, ids: list[int]) -> None:
                await asyncio.to_thread(_write_blocking, mapping, ids, kv, ready)

            done = await hand_off(lessee, address, rid, kv, write, leased)
            state.metrics.kv_transfer_seconds.labels("reference").observe(done.seconds)
            return done.handle.to_dict()
        except ArenaError as e:  # this decode worker's pool cannot be mapped here: not for this peer
            why = lessee.unusable[address] = str(e)
            log.warning("KV by reference unusable with %s (%s): the copy path serves it", address, why)
        except (RefError, ConnectionError, TimeoutError, OSError) as e:  # e.g. no room, lessor gone
            why = f"{type(e).__name__}: {e}"
    lessee.stats.fell_back += 1
    if mode == "on":
        raise RefError(f"KV by reference failed and kv_transfer.by_reference is 'on': {why}")
    return None


async def admit_by_reference(state, body, params: SamplingParams):
    """Claim the lease named by the handle and adopt its blocks. (queue, transfer info), or
    (None, {"error": ...}); a dead lease is a failed transfer (``kv_transfer.failure_policy``)."""
    loop, rid, lessor = state.loop, body.request_id, state.lessor
    kvc = state.config.kv_transfer
    if lessor is None:
        return None, {"error": "this worker takes no KV by reference"}
    try:
        handle = RefHandle.from_dict(body.kv)
    except RefError as e:
        return None, {"error": f"invalid kv handle: {e}"}
    if handle.request_id != rid:
        return None, {"error": "kv handle belongs to another request"}
    want = len(body.prompt_token_ids) + len(body.output_token_ids) - 1  # every token but the newest
    if handle.num_tokens != want:  # the blocks may hold one more token: adopted, a slot nobody wrote would be read
        return None, {"error": f"invalid kv handle: the KV of {handle.num_tokens} tokens, this request's is {want}"}
    t0 = time.perf_counter()
    try:
        lease = lessor.claim(handle)
    except RefError as e:
        state.metrics.kv_transfer_failures.labels("reference").inc()
        log.warning("KV by reference for %s failed: %s", rid, e)
        if kvc.failure_policy == "fail":
            return None, {"error": f"KV transfer failed: {e}"}
        q = await loop.add_request(rid, body.prompt_token_ids, params, output_token_ids=body.output_token_ids)
        return q, {"kv_transport": "recompute"}
    adopted = False
    q = loop.open_stream(rid)
    try:
        deadline = time.monotonic() + state.config.router.request_timeout_s
        while True:
            # never cancelled half-way: whether the blocks are the sequence's must be known for sure
            call = asyncio.ensure_future(
                loop.call(
                    lambda: loop.engine.adopt_prefilled(
                        rid, body.prompt_token_ids, body.output_token_ids, params, lease.block_ids
                    )
                )
            )
            try:
                adopted = await asyncio.shield(call)
            except asyncio.CancelledError:
                while not call.done():
                    with contextlib.suppress(BaseException):
                        await asyncio.shield(call)
                adopted = not call.cancelled() and call.exception() is None and bool(call.result())
                raise
            if adopted:
                break
            if time.monotonic() > deadline:
                raise TimeoutError("no decode slot for the adopted KV")
            await asyncio.sleep(0.005)  # max_num_seqs running: back-pressure, as a reservation waits
    except ValueError as e:
        loop.close_stream(rid, q)
        await lessor.give_back(lease)
        return None, {"error": f"kv adopt failed: {e}"}
    except BaseException:
        if adopted:
            loop.abort_nowait(rid)
        else:
            loop.close_stream(rid, q)
            await lessor.give_back(lease)
        raise
    loop.wake()
    elapsed = time.perf_counter() - t0
    state.metrics.kv_transfer_seconds.labels("reference").observe(elapsed)
    return q, {"kv_transfer_seconds": elapsed, "kv_transfer_bytes": 0, "kv_transport": "reference"}
