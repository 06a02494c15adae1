"""A real peer process for the by-reference protocol tests (tests/unit/test_kv_by_reference.py).

``python -m tests.unit.kv_ref_peer lessee ADDRESS TOKEN SCENARIO``: one prefill-side lessee that leases,
writes a known KV and reports it (JSON lines on stdout), then exits or waits to be killed.
``python -m tests.unit.kv_ref_peer lessor TOKEN``: a decode-side owner (arena in POSIX shm, a real block
manager) serving leases; prints its address and arena's shm name, then serves until killed.
"""

from __future__ import annotations

import asyncio
import json
import sys

import torch

from distserve.server.engine.block_manager import BlockManager
from distserve.server.kv_transfer.by_reference import BlockSource, KVLessee, KVLessor, hand_off
from distserve.server.kv_transfer.kv_arena import ArenaLayout, ArenaOwner

LAYOUT = ArenaLayout(num_layers=2, num_blocks=32, block_size=4, kv_heads=2, head_dim=4, dtype="float32")
NUM_TOKENS = 10


def known_kv(seed: int = 0) -> torch.Tensor:
    n = LAYOUT.num_layers * 2 * NUM_TOKENS * LAYOUT.kv_heads * LAYOUT.head_dim
    return (torch.arange(n, dtype=torch.float32) + seed * 1000).view(
        LAYOUT.num_layers, 2, NUM_TOKENS, LAYOUT.kv_heads, LAYOUT.head_dim
    )


def say(**kw) -> None:
    print(json.dumps(kw), flush=True)


async def write_into(mapping, ids) -> None:
    mapping.write(ids, known_kv())


async def lessee(address: str, token: str, scenario: str) -> None:
    le = KVLessee(token, LAYOUT, torch.device("cpu"), timeout_s=5.0)
    if scenario == "success":
        done = await hand_off(le, address, "req-a", known_kv(), write_into)
        say(handle=done.handle.to_dict())
    elif scenario == "hold":  # leased, being written (never reports it): killed like this
        _, lease_id, ids = await le.lease(address, "req-c", NUM_TOKENS)
        say(leased=ids)
        await asyncio.sleep(3600)
    elif scenario == "written-hold":  # written, hand-off in flight: killed like this
        done = await hand_off(le, address, "req-d", known_kv(), write_into)
        say(handle=done.handle.to_dict())
        await asyncio.sleep(3600)
    await le.close()


async def lessor(token: str) -> None:
    bm = BlockManager(LAYOUT.num_blocks, LAYOUT.block_size)
    owner = ArenaOwner(LAYOUT, torch.device("cpu"))

    async def take(n):
        return bm.take_blocks(n)

    async def give_back(blocks):
        bm.give_back(blocks)

    server = KVLessor("127.0.0.1", token, owner.description, BlockSource(take, give_back))
    address = await server.start()
    say(address=address, shm_name=owner.description.shm_name)
    while True:
        await asyncio.sleep(0.2)
        say(used=bm.num_used_blocks)


if __name__ == "__main__":
    role = sys.argv[1]
    if role == "lessee":
        asyncio.run(lessee(sys.argv[2], sys.argv[3], sys.argv[4]))
    else:
        asyncio.run(lessor(sys.argv[2]))
