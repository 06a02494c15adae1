"""Routing that knows the caches and the SLOs, through real components: a real tiny-model engine
fills its prefix cache, its worker state builds the heartbeat summary, the router's registry indexes it and
picks; outlier ejection and conditional disaggregation decide on real registry entries."""

from __future__ import annotations

import time

import pytest
from pydantic import ValidationError

from distserve.server.config import DistServeConfig, OutlierConfig, load_config
from distserve.server.engine.llm_engine import EngineConfig, LLMEngine
from distserve.server.engine.sampling_params import SamplingParams
from distserve.server.metrics import RouterMetrics, WorkerMetrics
from distserve.server.prefix_hash import chain_digests
from distserve.server.router.pipeline import Pipeline, PipelineOptions
from distserve.server.router.registry import WorkerRegistry
from distserve.server.wire import MAX_PREFIX_BLOCKS, HeartbeatRequest, RegisterRequest, WorkerStatus
from distserve.server.workers.app import WorkerState
from distserve.server.workers.engine_loop import EngineLoop
from tests.unit.test_engine_scheduling import assert_engine_empty

BS = 4
GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
PROMPT = [1] + [(7 * j + 3) % 400 + 3 for j in range(40)]  # 41 tokens: 10 full blocks of 4


def _reg(wid: str, role: str = "prefill", pid: int = 1, status: WorkerStatus | None = None) -> RegisterRequest:
    return RegisterRequest(
        worker_id=wid,
        role=role,
        url=f"http://127.0.0.1:1/{wid}",
        pid=pid,
        fingerprint={"m": 1},
        max_model_len=512,
        status=status or WorkerStatus(),
    )


@pytest.fixture(scope="module")
def warm():
    """A worker state whose engine has served PROMPT (its blocks are cached), and a cold one."""
    states = []
    for wid in ("p0", "p1"):
        engine = LLMEngine(EngineConfig(block_size=BS, num_blocks=128))
        states.append(
            WorkerState(
                role="prefill",
                worker_id=wid,
                config=DistServeConfig(),
                token="t",
                loop=EngineLoop(engine),
                metrics=WorkerMetrics("prefill"),
            )
        )
    states[0].loop.engine.generate([PROMPT], GREEDY)
    assert_engine_empty(states[0].loop.engine)
    return states


def test_the_router_hashes_prompts_as_the_block_manager_names_blocks(warm):
    bm = warm[0].loop.engine.block_manager
    version, cached = bm.cached_digests(MAX_PREFIX_BLOCKS)
    assert version == bm.cache_version > 0
    mine = chain_digests(PROMPT, BS)
    assert set(mine[:10]) <= set(cached)  # every full prompt block (generated tokens may add more)
    assert chain_digests(PROMPT[:9], BS) == mine[:2] and chain_digests([9] + PROMPT[1:], BS)[0] != mine[0]


def test_the_cached_worker_wins_at_equal_load_and_the_idle_one_when_it_is_saturated(warm):
    reg = WorkerRegistry(heartbeat_timeout_s=30, prefix_cache_weight=2.0)
    for s in warm:
        hb = s.heartbeat_status()
        assert hb.prefix_block_size == BS and hb.prefix_blocks is not None
        reg.register(_reg(s.worker_id, status=hb))
    assert reg.prefix.num_blocks("p0") >= 10 and reg.prefix.num_blocks("p1") == 0
    assert reg.cached_tokens(PROMPT, list(reg.workers.values())) == {"p0": 40, "p1": 0}
    # equal loads: every pick of this prompt goes to p0 (least-load would alternate)
    assert [reg.pick("prefill", token_ids=PROMPT).worker_id for _ in range(4)] == ["p0"] * 4
    assert reg.workers["p0"].prefix_hits == 4 and reg.last_pick_cached_tokens == 40
    # another prompt: no hit anywhere, the least-load pick takes turns
    other = [2] + PROMPT[1:]
    assert {reg.pick("prefill", token_ids=other).worker_id for _ in range(2)} == {"p0", "p1"}
    # p0 busy by more than the weight: the idle worker is worth more than the cache
    reg.workers["p0"].inflight = 3
    assert reg.pick("prefill", token_ids=PROMPT).worker_id == "p1"
    reg.workers["p0"].inflight = 1
    assert reg.pick("prefill", token_ids=PROMPT).worker_id == "p0"  # within the weight: still the cache
    reg.prefix_cache_weight = 0.0  # off: least load only
    assert reg.pick("prefill", token_ids=PROMPT).worker_id == "p1"


def test_unchanged_summaries_are_not_resent_and_a_missed_one_is_dropped(warm):
    s = warm[0]
    s.heartbeat_status()  # full, or "unchanged" if an earlier test sent it
    again = s.heartbeat_status()
    assert again.prefix_blocks is None and again.prefix_version == s.summary_sent_version  # "unchanged"
    reg = WorkerRegistry(heartbeat_timeout_s=30)
    reg.register(_reg("p0", status=WorkerStatus(prefix_block_size=BS, prefix_version=7, prefix_blocks=[])))
    reg.heartbeat("p0", WorkerStatus(prefix_block_size=BS, prefix_version=7))  # same version: kept
    assert "p0" in reg.prefix.of_worker
    digests = [d.hex() for d in chain_digests(PROMPT, BS)]
    reg.heartbeat("p0", WorkerStatus(prefix_block_size=BS, prefix_version=8, prefix_blocks=digests))
    assert reg.prefix.expected_hits(PROMPT, ["p0"]) == {"p0": 10}
    reg.heartbeat("p0", WorkerStatus(prefix_block_size=BS, prefix_version=9))  # version 9 never seen
    assert "p0" not in reg.prefix.of_worker and not reg.prefix.by_digest
    # a smaller summary replaces (an eviction shows at once), never merges
    reg.heartbeat("p0", WorkerStatus(prefix_block_size=BS, prefix_version=10, prefix_blocks=digests))
    reg.heartbeat("p0", WorkerStatus(prefix_block_size=BS, prefix_version=11, prefix_blocks=digests[:3]))
    assert reg.prefix.expected_hits(PROMPT, ["p0"]) == {"p0": 3}


def test_restarted_dead_gone_and_stale_workers_lose_their_entries():
    digests = [d.hex() for d in chain_digests(PROMPT, BS)]
    full = WorkerStatus(prefix_block_size=BS, prefix_version=1, prefix_blocks=digests)
    reg = WorkerRegistry(heartbeat_timeout_s=30, prefix_summary_max_age_s=5.0)
    reg.register(_reg("p0", pid=10, status=full))
    reg.register(_reg("p1", status=full))
    reg.register(_reg("p2", status=full))
    # p0 restarted: a new process registers under its id with a summary that is not (yet) sent
    reg.register(_reg("p0", pid=11, status=WorkerStatus(prefix_block_size=BS, prefix_version=1)))
    assert reg.prefix.expected_hits(PROMPT, ["p0", "p1"]) == {"p0": 0, "p1": 10}
    reg.mark_dead("p1", "exited")
    assert "p1" not in reg.prefix.of_worker
    reg.deregister("p2")
    assert not reg.prefix.by_digest  # nobody holds anything
    reg.register(_reg("p3", status=full))
    reg.prefix.of_worker["p3"].at -= 6.0  # older than the max age: counts as none
    assert reg.prefix.expected_hits(PROMPT, ["p3"]) == {"p3": 0}


def test_summary_sizes_and_digests_are_validated_on_the_wire():
    with pytest.raises(ValidationError, match="prefix_blocks"):
        WorkerStatus(prefix_block_size=BS, prefix_blocks=["00" * 16] * (MAX_PREFIX_BLOCKS + 1))
    with pytest.raises(ValidationError, match="prefix_blocks"):
        HeartbeatRequest.model_validate({"worker_id": "w", "status": {"prefix_blocks": ["xyz"]}})
    with pytest.raises(ValidationError, match="prefix_block_size"):
        WorkerStatus(prefix_block_size=-1)


def _pool(n: int, role: str = "prefill") -> WorkerRegistry:
    reg = WorkerRegistry(heartbeat_timeout_s=30, outlier=OutlierConfig(enabled=True, min_samples=4, ejection_s=10.0))
    for i in range(n):
        reg.register(_reg(f"{role[0]}{i}", role=role))
    return reg


def _feed(reg: WorkerRegistry, wid: str, seconds: float, n: int, now: float) -> None:
    w = reg.workers[wid]
    for _ in range(n):
        reg.outliers.record(w, seconds, list(reg.workers.values()), now)


def test_a_slow_worker_is_ejected_then_returns_and_the_last_one_never_is():
    reg = _pool(3)
    now = time.monotonic()  # pick sweeps on the real clock
    _feed(reg, "p0", 0.05, 6, now)
    _feed(reg, "p1", 0.06, 6, now)
    _feed(reg, "p2", 0.9, 3, now)
    assert not reg.workers["p2"].ejected_until  # fewer than min_samples: not judged yet
    _feed(reg, "p2", 0.9, 1, now)
    assert reg.workers["p2"].ejected_until == now + 10.0
    assert all(reg.pick("prefill").worker_id != "p2" for _ in range(4))
    d = reg.workers["p2"].to_dict(now)
    assert d["ejected"] is True
    _feed(reg, "p0", 5.0, 20, now)  # max share 0.5 of 3: one ejected at most
    assert not reg.workers["p0"].ejected_until
    reg.workers["p0"].latency.clear()
    reg.outliers.release_due(reg.workers.values(), now + 10.0)
    assert not reg.workers["p2"].ejected_until and not reg.workers["p2"].latency  # judged afresh
    _feed(reg, "p2", 0.9, 4, now + 11)  # slow again: ejected for twice as long
    assert reg.workers["p2"].ejected_until == now + 11 + 20.0

    pair = _pool(2, "decode")
    _feed(pair, "d0", 0.01, 8, now)
    _feed(pair, "d1", 0.5, 8, now)
    assert pair.workers["d1"].ejected_until and not pair.workers["d0"].ejected_until
    _feed(pair, "d0", 9.0, 30, now)  # the only one left in rotation is never ejected
    assert not pair.workers["d0"].ejected_until
    pair.mark_dead("d0", "exited")
    assert pair.pick("decode").worker_id == "d1"  # every candidate ejected: ejection is ignored, no 503

    off = WorkerRegistry(heartbeat_timeout_s=30, outlier=OutlierConfig(enabled=False))
    off.register(_reg("p0"))
    off.register(_reg("p1"))
    _feed(off, "p0", 0.01, 10, now)
    _feed(off, "p1", 5.0, 10, now)
    assert not off.workers["p1"].ejected_until


def test_outlier_and_routing_settings_load_from_the_router_section(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("router:\n  prefix_cache_weight: 0\n  local_prefill_max_tokens: 32\n  outlier:\n    factor: 5\n")
    rc = load_config(p).router
    assert rc.prefix_cache_weight == 0 and rc.local_prefill_max_tokens == 32 and rc.outlier.factor == 5
    p.write_text("router:\n  outlier:\n    factor: 0.5\n")
    with pytest.raises(ValueError, match="factor"):
        load_config(p)


def test_conditional_disaggregation_decides_per_threshold():
    digests = [d.hex() for d in chain_digests(PROMPT, BS)]
    reg = WorkerRegistry(heartbeat_timeout_s=30)
    reg.register(_reg("p0"))
    reg.register(_reg("d0", role="decode", status=WorkerStatus(prefix_block_size=BS, prefix_blocks=digests[:8])))
    decode = reg.workers["d0"]

    def decide(**opts) -> bool:
        pipe = Pipeline(reg, None, RouterMetrics(), PipelineOptions(token="t", request_timeout_s=5, **opts))  # type: ignore[arg-type]
        return pipe._local_prefill(decode, PROMPT)

    assert not decide()  # default: always disaggregated
    assert decide(local_prefill_max_tokens=9)  # 41 tokens, 32 cached there: 9 to compute
    assert not decide(local_prefill_max_tokens=8)
    assert not decide(local_prefill_prefill_load=2.0)  # the prefill pool is idle
    reg.workers["p0"].inflight = 2
    assert decide(local_prefill_prefill_load=2.0)  # saturated, and the decode worker queues nothing
    reg.heartbeat("d0", WorkerStatus(num_waiting=1))
    assert not decide(local_prefill_prefill_load=2.0)  # ... unless it does


def test_a_prompt_just_prefilled_counts_until_the_next_summary_replaces_the_guess():
    reg = WorkerRegistry(heartbeat_timeout_s=30)
    reg.register(_reg("p0", status=WorkerStatus(prefix_block_size=BS, prefix_version=1, prefix_blocks=[])))
    reg.register(_reg("p1"))  # no summary: nothing is guessed for it
    reg.prefix.note_prefilled("p0", PROMPT)
    reg.prefix.note_prefilled("p1", PROMPT)
    assert reg.prefix.expected_hits(PROMPT + [5, 6], ["p0", "p1"]) == {"p0": 10, "p1": 0}
    reg.heartbeat("p0", WorkerStatus(prefix_block_size=BS, prefix_version=2, prefix_blocks=[]))  # evicted there
    assert reg.prefix.expected_hits(PROMPT, ["p0"]) == {"p0": 0} and not reg.prefix.by_digest
