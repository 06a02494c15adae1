"""Grammar engines on CPU: llguidance vs xgrammar, and what constrained decoding costs a decode step.

    .venv/bin/python -m bench.engine.grammar_cpu --out bench/results/cpu/engine-grammar.json [--rounds 5]

On SmolLM2's vocabulary (49 152 tokens; the tiny model's 512 are not what users run):
1. compile time of a typical JSON schema (nested object, enum, array, integer range), cold (a fresh
   compiler: what the first request with that schema pays) and cached (the engine's per-request cost
   once the schema is known: llguidance deep-copies a compiled matcher, xgrammar's compiler cache hits
   and a matcher is made);
2. mask cost per decode step at batch 1/32/64: every row's next-token bitmask filled on the host, rows at
   realistic positions along a valid answer (llguidance rows one by one below 8 rows and through its
   thread pool from 8, as the engine does; xgrammar rows one by one, its documented CPU path);
3. the engine's decode step, free vs JSON-schema constrained, at batch 1/32/64 on the tiny model and on
   SmolLM2 (``StructuredDecoding.mask_logits`` included: bitmask, unpack, masked_fill), interleaved per round.
xgrammar is measured only where importable (it is not a project dependency: put a folder holding it on
``PYTHONPATH``). Medians over rounds; the spread (min-max) is the noise of a shared machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.lib.results import write_result

if TYPE_CHECKING:  # the server's modules are imported inside the functions (after torch's thread count is set)
    from distserve.server.engine.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[2]

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address", "tags", "active"],
    "additionalProperties": False,
}
ANSWER = {
    "name": "Ada Lovelace",
    "age": 36,
    "role": "admin",
    "address": {"street": "12 St James's Square", "city": "London", "zip": "SW1Y 4JH"},
    "tags": ["math", "engines", "poetry"],
    "active": True,
}


def med(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def timed(fn: Callable[[], object], reps: int = 1) -> float:
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def llguidance_rows(tok: Tokenizer, answer_ids: list[int], rounds: int, batches: list[int]) -> dict[str, Any]:
    import llguidance
    import torch

    from distserve.server.engine.structured.decoding import PARALLEL_FROM, _TokenizerView
    from distserve.server.engine.structured.grammar import Constraint, to_grammar

    t0 = time.perf_counter()
    view = _TokenizerView(tok, tok.vocab_size)
    lltok = llguidance.LLTokenizer(
        llguidance.TokenizerWrapper(view), n_vocab=tok.vocab_size, eos_token=tok.eos_token_id
    )
    tokenizer_s = time.perf_counter() - t0
    grammar = to_grammar(Constraint("json", json.dumps(SCHEMA)))
    cold = [
        timed(lambda: llguidance.LLMatcher(lltok, to_grammar(Constraint("json", json.dumps(SCHEMA)))))
        for _ in range(rounds)
    ]
    base = llguidance.LLMatcher(lltok, grammar)
    assert not base.is_error(), base.get_error()
    cached = [timed(lambda: base.deep_copy(), 50) for _ in range(rounds)]
    executor = llguidance.LLExecutor()
    words = (tok.vocab_size + 31) // 32
    out: dict[str, Any] = {
        "tokenizer_build_s": tokenizer_s,
        "compile_cold_s": med(cold),
        "compile_cached_s": med(cached),
        "mask_ms": {},
        "mask_pool_ms": {},
        "parallel_from_rows": PARALLEL_FROM,
    }
    for b in batches:
        # rows spread along the answer: row k has consumed k * len / b tokens
        ms: list[float] = []
        pool: list[float] = []
        for _ in range(rounds):
            matchers = []
            for k in range(b):
                m = base.deep_copy()
                m.consume_tokens(answer_ids[: (k * len(answer_ids)) // max(b, 1)])
                matchers.append(m)
            bitmask = torch.empty((b, words), dtype=torch.int32)
            ptr = bitmask.data_ptr()

            def fill() -> None:  # the CPU worker's path: row by row on its own core
                for k, m in enumerate(matchers):
                    m.unsafe_compute_mask_ptr(ptr + k * words * 4, words * 4)

            def fill_pool() -> None:  # the GPU worker's path from PARALLEL_FROM rows: llguidance's thread pool
                executor.unsafe_compute_mask_ptr([(m, k) for k, m in enumerate(matchers)], ptr, words * 4, b)

            ms.append(timed(fill, 5) * 1000)
            pool.append(timed(fill_pool, 5) * 1000)
        out["mask_ms"][str(b)] = med(ms)
        out["mask_pool_ms"][str(b)] = med(pool)
    return out


def xgrammar_rows(tok: Tokenizer, answer_ids: list[int], rounds: int, batches: list[int]) -> dict[str, Any] | str:
    try:
        import torch
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast
    except ImportError as e:
        return f"not importable: {e}"
    hf = PreTrainedTokenizerFast(tokenizer_object=tok._tok)
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=tok.vocab_size)
    tokenizer_s = time.perf_counter() - t0
    schema = json.dumps(SCHEMA)
    cold: list[float] = []
    for _ in range(rounds):
        compiler = xgr.GrammarCompiler(info, cache_enabled=True)
        cold.append(timed(lambda: compiler.compile_json_schema(schema, any_whitespace=False)))
    compiled = compiler.compile_json_schema(schema, any_whitespace=False)
    cached = [
        timed(lambda: xgr.GrammarMatcher(compiler.compile_json_schema(schema, any_whitespace=False)), 50)
        for _ in range(rounds)
    ]
    out: dict[str, Any] = {
        "tokenizer_build_s": tokenizer_s,
        "compile_cold_s": med(cold),
        "compile_cached_s": med(cached),
        "mask_ms": {},
    }
    for b in batches:
        ms: list[float] = []
        for _ in range(rounds):
            matchers = []
            for k in range(b):
                m = xgr.GrammarMatcher(compiled)
                for t in answer_ids[: (k * len(answer_ids)) // max(b, 1)]:
                    m.accept_token(t)
                matchers.append(m)
            bitmask = xgr.allocate_token_bitmask(b, info.vocab_size)

            def fill() -> None:
                for k, m in enumerate(matchers):
                    m.fill_next_token_bitmask(bitmask, k)

            ms.append(timed(fill, 5) * 1000)
        out["mask_ms"][str(b)] = med(ms)
    del torch
    return out


def engine_steps(model: str | None, batches: list[int], rounds: int, steps: int) -> dict[str, dict[str, Any]]:
    """Median decode-step seconds, free vs constrained, per batch (rounds interleaved)."""
    from distserve.server.engine.llm_engine import EngineConfig, LLMEngine
    from distserve.server.engine.sampling_params import SamplingParams
    from distserve.server.engine.structured.grammar import Constraint

    engine = LLMEngine(EngineConfig(model=model, max_num_seqs=max(batches), kv_cache_memory_mb=256))
    # an answer that can go on for as long as we time it: a list of free strings
    long_schema = {
        "type": "object",
        "properties": {"notes": {"type": "array", "items": {"type": "string"}}},
        "required": ["notes"],
    }
    c = Constraint("json", json.dumps(long_schema))
    engine.structured.prepare(c)
    prompt = [1] + list(range(20, 52))

    def run(b: int, constrained: bool) -> float:
        for i in range(b):
            p = SamplingParams(
                max_tokens=steps + 4, temperature=1.0, seed=i, ignore_eos=True, structured=c if constrained else None
            )
            engine.add_request(f"r{i}-{time.monotonic_ns()}", prompt + [60 + i], p)
        engine.step()  # the prefill of all rows
        ts: list[float] = []
        for _ in range(steps):
            t = time.perf_counter()
            engine.step()
            ts.append(time.perf_counter() - t)
        for rid in list(engine.requests):
            engine.abort_request(rid)
        return statistics.median(ts)

    out: dict[str, dict[str, Any]] = {}
    for b in batches:
        free: list[float] = []
        cons: list[float] = []
        for r in range(rounds):
            for constrained in (False, True) if r % 2 == 0 else (True, False):
                (cons if constrained else free).append(run(b, constrained))
        out[str(b)] = {
            "free_step_ms": med([x * 1000 for x in free]),
            "constrained_step_ms": med([x * 1000 for x in cons]),
            "overhead_pct": 100 * (statistics.median(cons) / statistics.median(free) - 1),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)  # a CPU worker owns one core
    from distserve.server.engine.loader import load_tokenizer, resolve_model_path

    tok = load_tokenizer(resolve_model_path("smollm2-135m-instruct"))
    answer_ids = tok.encode(json.dumps(ANSWER), add_bos=False)
    batches = [1, 32, 64]
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {__import__('os').cpu_count()} CPUs (shared)",
        "schema": SCHEMA,
        "answer_tokens": len(answer_ids),
        "vocab": tok.vocab_size,
        "llguidance": llguidance_rows(tok, answer_ids, args.rounds, batches),
        "xgrammar": xgrammar_rows(tok, answer_ids, args.rounds, batches),
        "engine_step_tiny": engine_steps(None, batches, args.rounds, args.steps),
        "engine_step_smollm2": engine_steps("smollm2-135m-instruct", batches, max(2, args.rounds // 2), args.steps),
    }
    write_result(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if k != "schema"}, indent=1))


if __name__ == "__main__":
    main()
