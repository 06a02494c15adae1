"""KV hand-off by reference (server/kv_transfer/by_reference.py, kv_arena.py) on the CPU: the pool in POSIX
shared memory, the ownership protocol between real processes, and the leak invariants — every block back to
its owner after success, release, abort, expiry and either side SIGKILLed; tokens equal to the copy path."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import pytest
import torch

from distserve.server.engine.block_manager import BlockManager
from distserve.server.engine.llm_engine import EngineConfig, LLMEngine
from distserve.server.engine.sampling_params import SamplingParams
from distserve.server.kv_transfer.by_reference import (
    BlockSource,
    KVLessee,
    KVLessor,
    RefError,
    RefHandle,
    blocks_for,
    check_block_ids,
    hand_off,
)
from distserve.server.kv_transfer.kv_arena import (
    ARENA_PREFIX,
    ArenaDescription,
    ArenaError,
    ArenaLayout,
    ArenaMapping,
    ArenaOwner,
    layout_for,
)
from distserve.server.preflight import sweep_orphan_segments
from tests.unit.kv_ref_peer import LAYOUT, NUM_TOKENS, known_kv

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "t" * 32
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[1] + [(5 * i + 11 * j) % 400 + 3 for j in range(n)] for i, n in enumerate([7, 12, 3, 16])]


# ------------------------------------------------------------------ engine: adopt equals copy
def test_adopted_blocks_decode_the_same_tokens_as_the_copy_path():
    """Prefill engine → KV written into leased blocks of a decode engine whose pool is a shm arena →
    adopted (no scatter) → the tokens of the copy path (reserve + commit) and of a colocated run."""
    prefill = LLMEngine(EngineConfig(block_size=4, num_blocks=64))
    by_ref = LLMEngine(EngineConfig(block_size=4, num_blocks=64, kv_arena="on"))
    by_copy = LLMEngine(EngineConfig(block_size=4, num_blocks=64, enable_prefix_caching=False))
    reference = [by_copy.generate([p], GREEDY)[0] for p in PROMPTS]  # colocated
    assert by_ref.kv_arena is not None and by_ref.kv_arena.description.kind == "shm"
    local = layout_for(prefill.model_config, 1, 4, prefill.runner.kv_dtype)
    mapping = ArenaMapping(by_ref.kv_arena.description, local, torch.device("cpu"))
    try:
        for i, prompt in enumerate(PROMPTS):
            rid = f"r{i}"
            prefill.add_request(rid, prompt, GREEDY, prefill_only=True)
            while not [o for o in prefill.step() if o.request_id == rid]:
                pass
            seq, kv = prefill.take_prefilled_kv(rid)
            first = list(seq.output_token_ids)
            ids = by_ref.block_manager.take_blocks(blocks_for(kv.shape[2], 4))
            assert ids is not None
            mapping.write(ids[: -(-kv.shape[2] // 4)], kv)  # the prefill process's write, through its mapping
            assert by_ref.adopt_prefilled(rid, prompt, first, GREEDY, ids)
            assert by_copy.reserve_prefilled(rid, prompt, first, GREEDY)
            by_copy.commit_prefilled(rid, kv)
            for engine in (by_ref, by_copy):
                tokens = list(first)
                while engine.has_unfinished_requests():
                    for o in engine.step():
                        tokens.extend(o.new_token_ids)
                assert tokens == reference[i]
        for engine in (prefill, by_ref, by_copy):
            engine.block_manager.check_invariants()
            assert engine.block_manager.num_used_blocks == 0
    finally:
        mapping.close()
        by_ref.kv_arena.close()


def test_adopt_refuses_blocks_that_do_not_fit_and_changes_nothing():
    engine = LLMEngine(EngineConfig(block_size=4, num_blocks=16, kv_arena="on"))
    try:
        ids = engine.block_manager.take_blocks(2)
        with pytest.raises(ValueError, match="KV blocks"):
            engine.adopt_prefilled("x", list(range(3, 13)), [5], GREEDY, ids)  # 11 tokens need 3 blocks
        assert "x" not in engine.requests
        engine.block_manager.give_back(ids)
        engine.block_manager.check_invariants()
        assert engine.block_manager.num_used_blocks == 0
        assert engine.block_manager.take_blocks(17) is None
    finally:
        engine.kv_arena.close()


# ------------------------------------------------------------------ wire validation
def test_handles_and_descriptions_are_validated_field_by_field():
    good = {
        "transport": "reference",
        "request_id": "r",
        "arena_id": "a" * 32,
        "lease_id": "b" * 32,
        "num_tokens": 5,
        "block_ids": [1, 2],
    }
    assert RefHandle.from_dict(good).block_ids == (1, 2)
    for bad in (
        {**good, "extra": 1},
        {**good, "block_ids": [1, 1]},
        {**good, "block_ids": [1, -1]},
        {**good, "block_ids": [True]},
        {**good, "block_ids": []},
        {**good, "num_tokens": "5"},
        {**good, "lease_id": "B" * 32},
        {**good, "arena_id": "../etc"},
    ):
        with pytest.raises(RefError):
            RefHandle.from_dict(bad)
    with pytest.raises(RefError, match="outside the pool"):
        check_block_ids([0, 32], 32)
    desc = ArenaOwner(LAYOUT, torch.device("cpu"))
    try:
        d = desc.description.to_dict()
        assert ArenaDescription.from_dict(d) == desc.description
        for bad in (
            {**d, "shm_name": "/dev/../x"},
            {**d, "kind": "nccl"},
            {**d, "ipc": "{}"},
            {**d, "layout": {**d["layout"], "num_blocks": 0}},
            {**d, "layout": {**d["layout"], "dtype": "object"}},
        ):
            with pytest.raises(ArenaError):
                ArenaDescription.from_dict(bad)
        other = ArenaLayout(**{**LAYOUT.to_dict(), "head_dim": 8})
        with pytest.raises(ArenaError, match="head_dim"):
            ArenaMapping(desc.description, other, torch.device("cpu"))
    finally:
        desc.close()


# ------------------------------------------------------------------ protocol between real processes
class Owner:
    """The decode side in this process: a block manager, an arena in shm and a lessor."""

    def __init__(self, lease_ms: float = 30_000) -> None:
        self.bm = BlockManager(LAYOUT.num_blocks, LAYOUT.block_size)
        self.arena = ArenaOwner(LAYOUT, torch.device("cpu"))

        async def take(n):
            return self.bm.take_blocks(n)

        async def give_back(blocks):
            self.bm.give_back(blocks)

        self.lessor = KVLessor(
            "127.0.0.1", TOKEN, self.arena.description, BlockSource(take, give_back), lease_ms=lease_ms
        )

    def slots(self, ids: list[int]) -> torch.Tensor:
        t = self.arena.tensor
        bs = LAYOUT.block_size
        slots = [b * bs + o for b in ids for o in range(bs)][:NUM_TOKENS]
        return t[:, :, slots]

    def assert_all_free(self) -> None:
        self.bm.check_invariants()
        assert self.bm.num_used_blocks == 0
        assert not self.lessor.leases


async def _peer(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.unit.kv_ref_peer",
        *args,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


async def _line(proc: asyncio.subprocess.Process) -> dict:
    assert proc.stdout is not None
    raw = await asyncio.wait_for(proc.stdout.readline(), 60)
    assert raw, "the peer exited without answering"
    return json.loads(raw)


async def _until(cond, timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not cond():
        assert loop.time() < end, "condition not reached"
        await asyncio.sleep(0.02)


def test_protocol_with_a_real_lessee_process_leaks_no_block():
    """success (adopted, then freed by the owner), release, a bad token, a lessee SIGKILLed while writing
    (reclaimed at once) and one SIGKILLed after reporting it written (kept for its hand-off until the
    deadline, then freed): the owner's block manager is whole after each."""

    async def main() -> None:
        owner = Owner(lease_ms=2000)
        address = await owner.lessor.start()
        try:
            # success: the bytes the other process wrote are in the owner's blocks; the hand-off adopts them
            p = await _peer("lessee", address, TOKEN, "success")
            handle = RefHandle.from_dict((await _line(p))["handle"])
            lease = owner.lessor.claim(handle)
            await p.wait()
            assert len(lease.block_ids) == blocks_for(NUM_TOKENS, LAYOUT.block_size)
            assert torch.equal(owner.slots(lease.block_ids), known_kv())
            with pytest.raises(RefError, match="expired or was released"):
                owner.lessor.claim(handle)  # a hand-off is taken once
            owner.bm.give_back(lease.block_ids)  # the sequence that adopted them finished
            owner.assert_all_free()

            # release before any hand-off, and a wrong token (refused before anything is described): in this
            # process, the lessee's identity does not matter to either
            local = KVLessee(TOKEN, LAYOUT, torch.device("cpu"), timeout_s=5.0)
            _, _, ids = await local.lease(address, "req-b", NUM_TOKENS)
            assert owner.bm.num_used_blocks == len(ids)
            assert await local.release("req-b") is True
            owner.assert_all_free()
            await local.close()
            intruder = KVLessee("not-the-token-" * 3, LAYOUT, torch.device("cpu"), timeout_s=5.0)
            with pytest.raises(RefError, match="auth"):
                await intruder.peer(address)

            # killed while writing: the lease goes back as soon as its connection closes
            p = await _peer("lessee", address, TOKEN, "hold")
            assert (await _line(p))["leased"]
            assert owner.bm.num_used_blocks == 3
            p.send_signal(signal.SIGKILL)
            await p.wait()
            await _until(lambda: owner.bm.num_used_blocks == 0)
            owner.assert_all_free()
            assert owner.lessor.stats.reclaimed == 1

            # killed after "written": the hand-off may still be on its way, so it waits for its deadline
            p = await _peer("lessee", address, TOKEN, "written-hold")
            handle = RefHandle.from_dict((await _line(p))["handle"])
            p.send_signal(signal.SIGKILL)
            await p.wait()
            await asyncio.sleep(0.1)
            assert owner.bm.num_used_blocks == 3  # still there for its hand-off
            await _until(lambda: owner.bm.num_used_blocks == 0)
            owner.assert_all_free()
            assert owner.lessor.stats.expired == 1
            with pytest.raises(RefError):
                owner.lessor.claim(handle)  # too late: the decode worker recomputes
        finally:
            await owner.lessor.close()
            owner.arena.close()

    asyncio.run(main())


def test_abort_frees_a_written_lease_and_mismatched_hand_offs_are_refused():
    async def main() -> None:
        owner = Owner()
        address = await owner.lessor.start()
        lessee = KVLessee(TOKEN, LAYOUT, torch.device("cpu"), timeout_s=5.0)
        try:

            async def write(mapping, ids):
                mapping.write(ids, known_kv())

            done = await hand_off(lessee, address, "req-x", known_kv(), write)
            h = done.handle
            for bad in (
                RefHandle("req-y", h.arena_id, h.lease_id, h.num_tokens, h.block_ids),
                RefHandle("req-x", "c" * 32, h.lease_id, h.num_tokens, h.block_ids),
                RefHandle("req-x", h.arena_id, h.lease_id, h.num_tokens, h.block_ids[::-1]),
                RefHandle("req-x", h.arena_id, h.lease_id, h.num_tokens + 1, h.block_ids),
            ):
                with pytest.raises(RefError):
                    owner.lessor.claim(bad)
            assert owner.bm.num_used_blocks == 3  # refusals leave the lease alone
            # no room while it holds its blocks: refused, nothing more held
            with pytest.raises(RefError, match="no room"):
                await lessee.lease(address, "huge", LAYOUT.num_blocks * LAYOUT.block_size - 1)
            assert owner.bm.num_used_blocks == 3
            assert await owner.lessor.abort_request("req-x") == 1  # /internal/abort on the decode worker
            owner.assert_all_free()
            # the prefill worker's abort after that finds nothing to give back
            assert await lessee.release("req-x") is False

            # a write that fails releases its lease
            async def broken(mapping, ids):
                raise OSError("device gone")

            with pytest.raises(OSError):
                await hand_off(lessee, address, "req-z", known_kv(), broken)
            await _until(lambda: owner.bm.num_used_blocks == 0)
            owner.assert_all_free()
        finally:
            await lessee.close()
            await owner.lessor.close()
            owner.arena.close()

    asyncio.run(main())


def test_a_killed_lessor_fails_the_next_hand_off_and_leaves_no_segment():
    """The decode worker (owner) SIGKILLed: the lessee's connection breaks, its mapping is dropped, the next
    hand-off raises (the prefill worker takes the copy path) and the next start removes the dead owner's
    segment."""

    async def main() -> None:
        p = await _peer("lessor", TOKEN)
        hello = await _line(p)
        lessee = KVLessee(TOKEN, LAYOUT, torch.device("cpu"), timeout_s=5.0)
        try:

            async def write(mapping, ids):
                mapping.write(ids, known_kv())

            done = await hand_off(lessee, hello["address"], "req-1", known_kv(), write)
            assert done.handle.num_tokens == NUM_TOKENS
            peer = await lessee.peer(hello["address"])
            assert (await _line(p))["used"] == 3  # the owner holds the written lease
            p.send_signal(signal.SIGKILL)
            await p.wait()
            await _until(lambda: peer.closed)
            assert peer.mapping.tensor is None
            with pytest.raises((ConnectionError, OSError)):
                await hand_off(lessee, hello["address"], "req-2", known_kv(), write)
        finally:
            await lessee.close()
        name = hello["shm_name"]
        sweep_orphan_segments(ARENA_PREFIX)
        assert not os.path.exists(f"/dev/shm/{name}")

    asyncio.run(main())


def test_a_lease_whose_caller_gave_up_is_given_back_when_granted():
    """The prefill handler cancelled (its client left) while the lease request was in flight: the lease the
    decode worker grants afterwards is released by the lessee at once, not held until its connection closes."""

    async def main() -> None:
        owner = Owner()
        granted = asyncio.Event()
        take = owner.lessor.blocks.take

        async def slow_take(n):
            await asyncio.sleep(0.3)
            ids = await take(n)
            granted.set()
            return ids

        owner.lessor.blocks = BlockSource(slow_take, owner.lessor.blocks.give_back)
        address = await owner.lessor.start()
        lessee = KVLessee(TOKEN, LAYOUT, torch.device("cpu"), timeout_s=5.0)
        try:
            task = asyncio.ensure_future(lessee.lease(address, "gone", NUM_TOKENS))
            await asyncio.sleep(0.1)
            task.cancel()
            await granted.wait()
            await _until(lambda: owner.bm.num_used_blocks == 0 and not owner.lessor.leases)
            assert owner.lessor.stats.released == 1
            owner.assert_all_free()
        finally:
            await lessee.close()
            await owner.lessor.close()
            owner.arena.close()

    asyncio.run(main())


def test_a_lease_refused_for_room_is_asked_again_until_granted_abandoned_or_out_of_time():
    """``room_wait_s``: a full pool's refusal is asked again (and granted once blocks free); without it, or
    once abandoned, or past it, the refusal stands and no block is held on either side."""

    async def main() -> None:
        owner = Owner()
        address = await owner.lessor.start()
        hog = owner.bm.take_blocks(owner.bm.num_free_blocks)  # the pool is full
        at_once = KVLessee(TOKEN, LAYOUT, torch.device("cpu"), timeout_s=5.0)
        waits: list[int] = []
        patient = KVLessee(
            TOKEN, LAYOUT, torch.device("cpu"), timeout_s=5.0, room_wait_s=30.0, on_room_wait=lambda: waits.append(1)
        )
        brief = KVLessee(TOKEN, LAYOUT, torch.device("cpu"), timeout_s=5.0, room_wait_s=0.2)
        try:
            with pytest.raises(RefError, match="no room"):
                await at_once.lease(address, "r0", NUM_TOKENS)
            with pytest.raises(RefError, match="after waiting for room"):
                await brief.lease(address, "r1", NUM_TOKENS)
            abandoned = asyncio.ensure_future(patient.lease(address, "r2", NUM_TOKENS))
            await _until(lambda: patient.waiting_for_room == 1)
            patient.abandon("r2")
            with pytest.raises(RefError, match="no room"):
                await abandoned
            assert patient.waiting_for_room == 0 and not owner.lessor.leases
            patient.abandon("r9")  # not leasing: remembered nowhere
            assert not patient._abandoned
            waiting = asyncio.ensure_future(patient.lease(address, "r3", NUM_TOKENS))
            await _until(lambda: patient.waiting_for_room == 1)
            owner.bm.give_back(hog)  # a sequence finished: room
            _, lease_id, ids = await asyncio.wait_for(waiting, 5.0)
            assert len(ids) == -(-NUM_TOKENS // LAYOUT.block_size) and lease_id in owner.lessor.leases
            assert patient.stats.room_waits == 2 and len(waits) == 2
            assert await patient.release("r3")
            owner.assert_all_free()
        finally:
            for lessee in (at_once, patient, brief):
                await lessee.close()
            await owner.lessor.close()
            owner.arena.close()

    asyncio.run(main())
