"""The by-reference ownership protocol (server/kv_transfer/by_reference.py) at fault moments: a lessee connection
reset while its writer lives and writes, a lessee gone before its lease is granted, releases duplicated or naming
an unknown or another connection's lease, lease messages with lying sizes and ids, a lessor whose grant does not
check out. The invariant each time: every block back to its owner (the decode worker's block manager), and no
block lent twice while a write into it may still land."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from distserve.server.kv_transfer.by_reference import (
    BlockSource,
    KVLessee,
    RefError,
    _lease_id,
    blocks_for,
    encode_message,
    hand_off,
    read_message,
)
from tests.unit.kv_ref_peer import LAYOUT, NUM_TOKENS, known_kv
from tests.unit.test_kv_by_reference import TOKEN, Owner, _until

CPU = torch.device("cpu")


def _write_into(t: torch.Tensor, ids: list[int], kv: torch.Tensor) -> None:
    """``ArenaMapping.write`` into a tensor taken before the write began (as a write already running does)."""
    bs = LAYOUT.block_size
    n = kv.shape[2]
    slots = (torch.tensor(ids)[:, None] * bs + torch.arange(bs)).reshape(-1)[:n]
    for layer in range(t.shape[0]):
        t[layer].index_copy_(1, slots, kv[layer].to(t.dtype))


def _block_slots(ids: list[int]) -> list[int]:
    bs = LAYOUT.block_size
    return [b * bs + o for b in ids for o in range(bs)]


def test_a_reset_connection_does_not_lend_the_blocks_its_live_writer_is_writing():
    """The lessee's connection is reset (a drill's TCP reset, a middlebox) while the prefill worker, alive, is still
    writing into its leased blocks. Before: the lessor freed them at once as if the writer were dead, lent them to
    the next request, and the late write landed in that request's KV. Now a lease whose writer's process still
    lives is held until the lease deadline (or that process exits), then freed."""

    async def main() -> None:
        owner = Owner(lease_ms=800)
        address = await owner.lessor.start()
        lessee = KVLessee(TOKEN, LAYOUT, CPU, timeout_s=5.0)
        other = KVLessee(TOKEN, LAYOUT, CPU, timeout_s=5.0)
        started, gate = asyncio.Event(), asyncio.Event()
        late: list[int] = []

        async def slow_write(mapping, ids):
            t = mapping.tensor  # the write has begun: it holds the mapping
            late.extend(ids)
            started.set()
            await gate.wait()
            _write_into(t, ids, known_kv(1))

        try:
            task = asyncio.ensure_future(hand_off(lessee, address, "late", known_kv(1), slow_write))
            await started.wait()
            (await lessee.peer(address)).writer.transport.abort()  # RST; this process (the writer) lives on
            await _until(lambda: owner.lessor._conns == 0)
            await asyncio.sleep(0.05)
            free = owner.bm.num_free_blocks
            _, _, ids = await other.lease(address, "next", free * LAYOUT.block_size - 1)  # every free block
            assert not set(ids) & set(late), "a block being written was lent again"
            t = owner.arena.tensor
            t[:, :, _block_slots(ids)] = -7.0
            gate.set()
            with pytest.raises((ConnectionError, OSError)):
                await task
            assert bool((t[:, :, _block_slots(ids)] == -7.0).all()), "the late write landed in another lease"
            assert await other.release("next") is True
            await _until(lambda: owner.bm.num_used_blocks == 0)  # the reset lease at its deadline
            owner.assert_all_free()
            assert owner.lessor.stats.reclaimed == 1
        finally:
            await lessee.close()
            await other.close()
            await owner.lessor.close()
            owner.arena.close()

    asyncio.run(main())


async def _raw(address: str, hello_extra: dict | None = None):
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(encode_message({"op": "hello", "token": TOKEN, **(hello_extra or {})}))
    await writer.drain()
    assert (await read_message(reader))["ok"] is True
    return reader, writer


async def _ask(reader, writer, msg: dict) -> dict:
    writer.write(encode_message(msg))
    await writer.drain()
    return await asyncio.wait_for(read_message(reader), 5)


def test_a_lessee_gone_before_its_lease_is_granted_gets_nothing_kept():
    """The connection closes while the lessor is still taking the blocks (between steps): the grant lands after
    the close and is reclaimed at once (this test process is no writer of it: it never got the ids)."""

    async def main() -> None:
        owner = Owner()
        take, granted = owner.lessor.blocks.take, asyncio.Event()

        async def slow_take(n):
            await asyncio.sleep(0.3)
            ids = await take(n)
            granted.set()
            return ids

        owner.lessor.blocks = BlockSource(slow_take, owner.lessor.blocks.give_back)
        address = await owner.lessor.start()
        try:
            reader, writer = await _raw(address)
            writer.write(encode_message({"seq": 1, "op": "lease", "request_id": "gone", "num_tokens": NUM_TOKENS}))
            await writer.drain()
            writer.close()
            await granted.wait()
            await _until(lambda: owner.bm.num_used_blocks == 0 and not owner.lessor.leases)
            owner.assert_all_free()
        finally:
            await owner.lessor.close()
            owner.arena.close()

    asyncio.run(main())


def test_duplicate_unknown_foreign_and_lying_messages_change_no_ownership():
    async def main() -> None:
        owner = Owner()
        address = await owner.lessor.start()
        try:
            r1, w1 = await _raw(address)
            r2, w2 = await _raw(address)
            got = await _ask(r1, w1, {"seq": 1, "op": "lease", "request_id": "a", "num_tokens": NUM_TOKENS})
            assert got["ok"] is True and len(got["block_ids"]) == blocks_for(NUM_TOKENS, LAYOUT.block_size)
            lease = _lease_id(got)
            # another connection may not release (nor report written) a lease being written
            bad = await _ask(r2, w2, {"seq": 2, "op": "release", "lease_id": lease})
            assert bad["ok"] is False and owner.bm.num_used_blocks == 3
            bad = await _ask(r2, w2, {"seq": 3, "op": "written", "lease_id": lease})
            assert bad["ok"] is False and owner.lessor.leases[lease].state == "leased"
            # unknown ids and ids that are no ids
            assert (await _ask(r1, w1, {"seq": 4, "op": "release", "lease_id": "0" * 32}))["released"] is False
            for junk in ("../etc", "A" * 32, 7, None, "0" * 33):
                assert (await _ask(r1, w1, {"seq": 5, "op": "release", "lease_id": junk}))["ok"] is False
            # lying sizes: each refused, nothing taken
            for n in (0, -1, 1.5, True, "10", 1 << 40, None, LAYOUT.num_blocks * LAYOUT.block_size):
                msg = {"seq": 6, "op": "lease", "request_id": "b", "num_tokens": n}
                assert (await _ask(r1, w1, msg))["ok"] is False, n
            for rid in ("", "x" * 257, 5, None):
                msg = {"seq": 7, "op": "lease", "request_id": rid, "num_tokens": NUM_TOKENS}
                assert (await _ask(r1, w1, msg))["ok"] is False, rid
            assert (await _ask(r1, w1, {"seq": 8, "op": "steal", "lease_id": lease}))["ok"] is False
            assert owner.bm.num_used_blocks == 3 and len(owner.lessor.leases) == 1
            # written, then released twice: freed once
            assert (await _ask(r1, w1, {"seq": 9, "op": "written", "lease_id": lease}))["ok"] is True
            assert (await _ask(r1, w1, {"seq": 10, "op": "written", "lease_id": lease}))["ok"] is False
            assert (await _ask(r1, w1, {"seq": 11, "op": "release", "lease_id": lease}))["released"] is True
            assert (await _ask(r1, w1, {"seq": 12, "op": "release", "lease_id": lease}))["released"] is False
            owner.assert_all_free()
            # a length prefix that lies (more than the limit; then fewer bytes than it says, and the close)
            w2.write(b"\xff\xff\xff\xff")
            await w2.drain()
            assert await r2.read() == b""  # the lessor hung up on it
            r3, w3 = await _raw(address)
            assert (await _ask(r3, w3, {"seq": 1, "op": "lease", "request_id": "c", "num_tokens": 3}))["ok"] is True
            w3.write(b"\x00\x00\x10\x00" + b'{"seq": 2, "op"')  # 4096 bytes announced, 15 sent, then reset
            await w3.drain()
            w3.transport.abort()
            await _until(lambda: owner.bm.num_used_blocks == 0)  # this test process never writes: reclaimed
            owner.assert_all_free()
            w1.close()
        finally:
            await owner.lessor.close()
            owner.arena.close()

    asyncio.run(main())


def test_a_grant_the_lessee_refuses_is_given_back():
    """A lessor whose grant does not check out (here one block more than the lease needs: a bug on the decode
    side) is refused by the lessee, which now also releases it; before, the lease stayed LEASED on a connection
    that stays open, and its blocks were never given back."""

    async def main() -> None:
        owner = Owner()
        take = owner.lessor.blocks.take

        async def one_more(n):
            return await take(n + 1)

        owner.lessor.blocks = BlockSource(one_more, owner.lessor.blocks.give_back)
        address = await owner.lessor.start()
        lessee = KVLessee(TOKEN, LAYOUT, CPU, timeout_s=5.0)
        try:
            with pytest.raises(RefError, match="expected 3"):
                await lessee.lease(address, "odd", NUM_TOKENS)
            await _until(lambda: owner.bm.num_used_blocks == 0 and not owner.lessor.leases)
            owner.assert_all_free()
            assert owner.lessor.stats.released == 1
        finally:
            await lessee.close()
            await owner.lessor.close()
            owner.arena.close()

    asyncio.run(main())


def test_a_hand_off_whose_token_count_is_not_the_requests_is_refused_not_adopted():
    """The by-reference hand-off names its KV's token count; the request that arrives with it may claim more tokens
    (here one more output token: the lease's 3 blocks hold it too). Before, the blocks were adopted and the decode
    read a KV slot nobody wrote for the token in between (stale bytes: wrong tokens, no error). Now the hand-off is
    refused as invalid, its lease kept for the right request until its abort or deadline."""
    import httpx

    from distserve.server.config import DistServeConfig
    from distserve.server.engine.llm_engine import EngineConfig, LLMEngine
    from distserve.server.engine.sampling_params import SamplingParams
    from distserve.server.kv_transfer.kv_arena import layout_for
    from distserve.server.metrics import WorkerMetrics
    from distserve.server.workers import kv_reference
    from distserve.server.workers.app import WorkerState, create_worker_app
    from distserve.server.workers.engine_loop import EngineLoop

    prompt = [3, 9, 8, 7, 6, 5, 4, 11, 12]  # 9 tokens: KV of 9, a lease of ceil(10 / 4) = 3 blocks
    prefill = LLMEngine(EngineConfig(block_size=4, num_blocks=64, attention_backend="sdpa"))
    decode = LLMEngine(EngineConfig(block_size=4, num_blocks=64, kv_arena="on", attention_backend="sdpa"))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prefill.add_request("r", prompt, params, prefill_only=True)
    while prefill.has_unfinished_requests():
        prefill.step()
    seq, kv = prefill.take_prefilled_kv("r")
    first = list(seq.output_token_ids)

    async def main():
        state = WorkerState(
            role="decode",
            worker_id="d0",
            config=DistServeConfig(),
            token=TOKEN,
            loop=EngineLoop(decode, threaded=True),
            metrics=WorkerMetrics("decode"),
        )
        state.lessor = kv_reference.make_lessor(state, "127.0.0.1")
        address = await state.lessor.start()
        state.loop.start()
        lessee = KVLessee(TOKEN, layout_for(prefill.model_config, 1, 4, prefill.runner.kv_dtype), CPU, timeout_s=5.0)
        try:

            async def write(mapping, ids):
                mapping.write(ids, kv)

            done = await hand_off(lessee, address, "r", kv, write)
            auth = {"Authorization": f"Bearer {TOKEN}"}
            sampling = {"max_tokens": 4, "temperature": 0.0, "top_p": 1.0, "ignore_eos": True}
            body = {"request_id": "r", "prompt_token_ids": prompt, "sampling": sampling, "kv": done.handle.to_dict()}
            app = create_worker_app(state)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://d") as http:
                lying = await http.post(
                    "/internal/generate", json={**body, "output_token_ids": first + [7]}, headers=auth
                )
                kept = decode.num_used_blocks
                r = await http.post("/internal/abort", json={"request_id": "r"}, headers=auth)
            return lying.text, kept, r.json()
        finally:
            await lessee.close()
            state.loop.stop()
            await state.lessor.close()

    try:
        lying, kept, abort = asyncio.run(main())
        last = [json.loads(x) for x in lying.splitlines() if x.strip()][-1]
        assert last["finished"] and "invalid kv handle" in (last.get("error") or ""), last
        assert kept == 3 and abort["aborted"] is True  # kept for the right request; the router's abort frees it
        assert decode.num_used_blocks == 0 and decode.requests == {}
        decode.block_manager.check_invariants()
    finally:
        decode.kv_arena.close()
