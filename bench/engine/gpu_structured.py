"""Structured outputs on one GPU: what a JSON-schema constrained decode step costs.

    python -m bench.engine.gpu_structured --make-tokenizer .gpu_assets/smollm2_tokenizer   # once, on CPU
    python3 -m bench.engine.gpu_structured --tokenizer .gpu_assets/smollm2_tokenizer --out $OUT/structured.json

The engine's decode step, free vs JSON-schema constrained, at batch 1/32/64, and a 50/50 mix at batch 64
(half the rows constrained), on a Llama-2-7B-shaped preset (random weights, bf16, triton attention,
decode CUDA graphs) whose vocabulary is widened to a real tokenizer's (SmolLM2's 49 152 byte-level BPE
tokens: grammar masks need real token strings; the 7B preset's own 32 000 ids have none). The grammar
engine (llguidance) fills each constrained row's bitmask on the host; the mask goes to the device once per
step and is applied there (``StructuredDecoding.mask_logits``). Greedy and OpenAI-default sampling (T=1).
Rounds interleave free and constrained; medians over rounds. A second shape, Llama-3-8B (128 256 ids,
the SmolLM2 strings padded), shows the cost with a wide vocabulary.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import time
from pathlib import Path

from bench.lib.results import write_result

CHECKS: list[str] = []  # the start of a constrained row's text per timed run (proof the mask applied)
LONG_SCHEMA = {  # an answer that goes on for as long as we time it: a list of free strings
    "type": "object",
    "properties": {"notes": {"type": "array", "items": {"type": "string"}}},
    "required": ["notes"],
}


def make_tokenizer(folder: Path) -> None:
    """SmolLM2's tokenizer as a folder ``Tokenizer.from_folder`` reads (3.4 MB: carried to the device)."""
    from distserve.server.engine import gguf_loader
    from distserve.server.engine.loader import resolve_model_path

    backend, bos, eos, _, _ = gguf_loader.build_tokenizer(
        gguf_loader.read_metadata(resolve_model_path("smollm2-135m-instruct"))
    )
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    (folder / "config.json").write_text(json.dumps({"vocab_size": 49152, "bos_token_id": bos, "eos_token_id": eos}))
    print(f"wrote {folder}")


def build(preset: str, vocab: int | None, tokenizer_dir: str, device: str):
    from distserve.server.engine import presets
    from distserve.server.engine.llm_engine import EngineConfig, LLMEngine
    from distserve.server.engine.tokenizer import Tokenizer

    name = preset
    if vocab is not None:  # the preset widened to the tokenizer's vocabulary
        name = f"{preset}-v{vocab}"
        presets.PRESETS[name] = dataclasses.replace(presets.PRESETS[preset], vocab_size=vocab)
    eng = LLMEngine(
        EngineConfig(
            model=f"preset:{name}",
            device=device,
            dtype="bfloat16",
            gpu_memory_utilization=0.85 if device == "cuda" else 0.0,
            max_num_seqs=64,
            max_num_batched_tokens=8192,
            attention_backend="triton" if device == "cuda" else "sdpa",
            kv_cache_memory_mb=512 if device == "cuda" else 256,  # CUDA: sized from gpu_memory_utilization
        )
    )
    tok = Tokenizer.from_folder(tokenizer_dir)
    eng._load_tokenizer = lambda: tok  # type: ignore[method-assign]  # grammars over the real tokenizer's strings
    eng.structured._load_tokenizer = eng._load_tokenizer  # (bound at construction; nothing compiled yet)
    return eng


def steps_ms(eng, b: int, constrained_rows: int, steps: int, temperature: float) -> float:
    import torch

    from distserve.server.engine.sampling_params import SamplingParams
    from distserve.server.engine.structured.grammar import Constraint

    c = Constraint("json", json.dumps(LONG_SCHEMA))
    eng.structured.prepare(c)
    prompt = [1] + list(range(300, 427))
    for i in range(b):
        p = SamplingParams(
            max_tokens=steps + 8,
            temperature=temperature,
            seed=i,
            ignore_eos=True,
            structured=c if i < constrained_rows else None,
        )
        eng.add_request(f"r{i}-{time.monotonic_ns()}", prompt + [500 + i], p)
    for _ in range(5):  # the prefills (64 x 129 tokens take two steps), then warm: graphs and masks steady
        eng.step()
    ts = []
    for _ in range(steps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.perf_counter()
        eng.step()
        ts.append(time.perf_counter() - t)
    if constrained_rows:  # the constrained rows really were constrained: their text is a JSON prefix
        seq = next(s for s in eng.requests.values() if s.request_id.startswith("r0-"))
        text = eng._load_tokenizer().decode(seq.output_token_ids)
        CHECKS.append(text[:60])
        assert text.lstrip().startswith("{"), f"constrained output is not JSON: {text[:60]!r}"
    for rid in list(eng.requests):
        eng.abort_request(rid)
    return 1000 * statistics.median(ts)


def study(eng, batches: list[int], rounds: int, steps: int, temperature: float) -> dict:
    out: dict = {}
    cases = [(b, b) for b in batches] + [(max(batches), max(batches) // 2)]
    for b, n_cons in cases:
        free: list[float] = []
        cons: list[float] = []
        for r in range(rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            for constrained in order:
                ms = steps_ms(eng, b, n_cons if constrained else 0, steps, temperature)
                (cons if constrained else free).append(ms)
        key = f"b{b}" if n_cons == b else f"b{b}_mix{n_cons}"
        f, c = statistics.median(free), statistics.median(cons)
        out[key] = {
            "free_ms": round(f, 3),
            "constrained_ms": round(c, 3),
            "overhead_pct": round(100 * (c / f - 1), 1),
            "free_spread_ms": [round(min(free), 3), round(max(free), 3)],
            "constrained_spread_ms": [round(min(cons), 3), round(max(cons), 3)],
            "constrained_rows": n_cons,
        }
        print(
            f"  {key} T={temperature}: free {f:.2f} ms, constrained {c:.2f} ms ({100 * (c / f - 1):+.1f} %)", flush=True
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokenizer", help="a tokenizer folder (tokenizer.json + config.json)")
    ap.add_argument("--make-tokenizer", metavar="DIR", help="export SmolLM2's tokenizer to DIR (on CPU) and exit")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batches", default="1,32,64")
    ap.add_argument("--shapes", default="llama-2-7b:49152,llama-3-8b")
    args = ap.parse_args()
    if args.make_tokenizer:
        make_tokenizer(Path(args.make_tokenizer))
        return
    if not args.tokenizer:
        ap.error("--tokenizer DIR is required (make one with --make-tokenizer DIR)")
    import torch

    batches = [int(x) for x in args.batches.split(",")]
    res: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": torch.cuda.get_device_name(0) if args.device == "cuda" else platform.processor() or "cpu",
        "schema": LONG_SCHEMA,
        "shapes": {},
    }
    out = Path(args.out)
    for spec in args.shapes.split(","):
        preset, _, v = spec.partition(":")
        t0 = time.time()
        eng = build(preset, int(v) if v else None, args.tokenizer, args.device)
        r: dict = {"vocab": eng.model_config.vocab_size, "build_s": round(time.time() - t0, 1)}
        print(f"{spec}: vocab {r['vocab']}, built in {r['build_s']} s", flush=True)
        for temp in (0.0, 1.0):
            r[f"T{temp:g}"] = study(eng, batches, args.rounds, args.steps, temp)
            r["constrained_text_samples"] = CHECKS[-3:]
            res["shapes"][spec] = r
            write_result(out, res)
        del eng
        import gc

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    write_result(out, res)


if __name__ == "__main__":
    main()
