"""``distserve make-tiny-model | generate``: the engine and its built-in model, in this process (no server)."""

from __future__ import annotations

import argparse
import json

from distserve.server.commands.common import usage_error


def _positive_int(name: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name} must be >= 1, got {value}")
        return value

    return parse


def _float_in(name: str, lo: float, hi: float, lo_open: bool = False):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
        ok = (value > lo if lo_open else value >= lo) and value <= hi
        if not ok:
            bracket = "(" if lo_open else "["
            raise argparse.ArgumentTypeError(f"{name} must be in {bracket}{lo}, {hi}], got {value}")
        return value

    return parse


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip() != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--prompt-ids must be comma-separated integers like 1,2,3, got {text!r}"
        ) from None
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-ids must contain at least one token id")
    if any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError("--prompt-ids must be non-negative")
    return ids


def _add_make_tiny_model(sub) -> None:
    p = sub.add_parser(
        "make-tiny-model",
        help="write a deterministic random-weight Llama in Hugging Face format",
        description="Write a deterministic random-weight Llama (config.json, model.safetensors, "
        "byte-level tokenizer) to OUT_DIR. Example: distserve make-tiny-model /tmp/tiny --layers 2",
    )
    p.add_argument("out_dir", help="folder to write (created if missing)")
    p.add_argument("--layers", type=_positive_int("--layers"), default=4, help="decoder layers")
    p.add_argument("--hidden", type=_positive_int("--hidden"), default=256, help="hidden size")
    p.add_argument("--heads", type=_positive_int("--heads"), default=4, help="attention heads")
    p.add_argument(
        "--kv-heads", type=_positive_int("--kv-heads"), default=None, help="key/value heads (default: --heads)"
    )
    p.add_argument(
        "--intermediate",
        type=_positive_int("--intermediate"),
        default=None,
        help="MLP size (default: Llama's 8/3 x hidden, rounded up to a multiple of 8)",
    )
    p.add_argument("--vocab", type=_positive_int("--vocab"), default=512, help="vocabulary size (>= 259)")
    p.add_argument(
        "--max-positions", type=_positive_int("--max-positions"), default=2048, help="max_position_embeddings"
    )
    p.add_argument("--seed", type=int, default=0, help="weight seed (same seed = byte-identical folder)")
    p.add_argument("--tie-word-embeddings", action="store_true", help="share embedding and lm_head weights")
    p.set_defaults(handler=cmd_make_tiny_model)


def _add_generate(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="generate from one prompt in-process (no server)",
        description="Generate from one prompt with the engine in this process. "
        "Example: distserve generate --prompt 'Hello' --max-tokens 8 --json",
    )
    p.add_argument(
        "--model",
        default=None,
        help="a Hugging Face Llama-family folder, a .gguf file, or a known name "
        "(smollm2-135m-instruct); default: the built-in random-weight tiny model",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (tokenized with the model's tokenizer)")
    src.add_argument("--prompt-ids", type=_token_ids, help="prompt as token ids, e.g. 1,2,3")
    p.add_argument("--max-tokens", type=_positive_int("--max-tokens"), default=16, help="tokens to generate")
    p.add_argument("--temperature", type=_float_in("--temperature", 0.0, 100.0), default=0.0, help="0 = greedy")
    p.add_argument(
        "--top-p",
        type=_float_in("--top-p", 0.0, 1.0, lo_open=True),
        default=1.0,
        help="nucleus sampling mass (1 = off)",
    )
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0 = off)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "float16", "bfloat16"],
        help="weights and activations (auto: float32 on CPU, the checkpoint's dtype on GPU)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object: token_ids, text, ...")
    p.set_defaults(handler=cmd_generate)


def cmd_make_tiny_model(args) -> int:
    from distserve.server.engine.tiny_model import make_tiny_model

    if args.hidden % args.heads:
        return usage_error(f"--hidden ({args.hidden}) must be a multiple of --heads ({args.heads})")
    kv = args.kv_heads or args.heads
    if args.heads % kv:
        return usage_error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({kv})")
    if args.vocab < 259:
        return usage_error(f"--vocab must be >= 259 (3 special + 256 byte tokens), got {args.vocab}")
    path = make_tiny_model(
        args.out_dir,
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=kv,
        intermediate=args.intermediate,
        vocab=args.vocab,
        max_positions=args.max_positions,
        seed=args.seed,
        tie_word_embeddings=args.tie_word_embeddings,
    )
    print(path)
    return 0


def cmd_generate(args) -> int:
    from distserve.server.engine.llm_engine import EngineConfig, LLMEngine
    from distserve.server.engine.loader import load_tokenizer
    from distserve.server.engine.sampling_params import SamplingParams
    from distserve.server.engine.tokenizer import Tokenizer

    if args.top_k < 0:
        return usage_error(f"--top-k must be >= 0, got {args.top_k}")
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
        )
        engine = LLMEngine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype))
    except (ValueError, FileNotFoundError) as e:
        return usage_error(str(e))
    # shape presets have no files: the byte tokenizer, as the router uses for them
    tokenizer = Tokenizer.byte_tokenizer() if engine.model_path is None else load_tokenizer(engine.model_path)
    prompt_ids = args.prompt_ids if args.prompt_ids is not None else tokenizer.encode(args.prompt)
    try:
        [token_ids] = engine.generate([prompt_ids], params)
    except ValueError as e:
        return usage_error(str(e))
    text = tokenizer.decode(token_ids)
    if args.json:
        print(json.dumps({"prompt_token_ids": prompt_ids, "token_ids": token_ids, "text": text}))
    else:
        print(text)
    return 0


def add_parsers(sub) -> None:
    _add_make_tiny_model(sub)
    _add_generate(sub)
