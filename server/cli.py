"""The ``distserve`` command line.

Every subcommand validates its arguments up front and exits with status 2 and
one sentence on bad input (argparse's convention), before loading a model.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

LOG_LEVEL_ENV = "DISTSERVE_LOG_LEVEL"


class _HelpWithDefaults(argparse.HelpFormatter):
    """Every option's help ends with its default, unless it says it already or has none worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (action.option_strings and "default" not in text and action.default not in (None, False)
                and action.default is not argparse.SUPPRESS):
            text += " (default: %(default)s)"
        return text


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _HelpWithDefaults)
        super().__init__(*args, **kwargs)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("distserve")
    except PackageNotFoundError:
        return "unknown (not installed)"


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
            f"--prompt-ids must be comma-separated integers like 1,2,3, got {text!r}") from None
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
    p.add_argument("--kv-heads", type=_positive_int("--kv-heads"), default=None,
                   help="key/value heads (default: --heads)")
    p.add_argument("--intermediate", type=_positive_int("--intermediate"), default=None,
                   help="MLP size (default: Llama's 8/3 x hidden, rounded up to a multiple of 8)")
    p.add_argument("--vocab", type=_positive_int("--vocab"), default=512, help="vocabulary size (>= 259)")
    p.add_argument("--max-positions", type=_positive_int("--max-positions"), default=2048,
                   help="max_position_embeddings")
    p.add_argument("--seed", type=int, default=0, help="weight seed (same seed = byte-identical folder)")
    p.add_argument("--tie-word-embeddings", action="store_true", help="share embedding and lm_head weights")


def _add_generate(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="generate from one prompt in-process (no server)",
        description="Generate from one prompt with the engine in this process. "
                    "Example: distserve generate --prompt 'Hello' --max-tokens 8 --json",
    )
    p.add_argument("--model", default=None,
                   help="a Hugging Face Llama-family folder, a .gguf file, or a known name "
                        "(smollm2-135m-instruct); default: the built-in random-weight tiny model")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (tokenized with the model's tokenizer)")
    src.add_argument("--prompt-ids", type=_token_ids, help="prompt as token ids, e.g. 1,2,3")
    p.add_argument("--max-tokens", type=_positive_int("--max-tokens"), default=16, help="tokens to generate")
    p.add_argument("--temperature", type=_float_in("--temperature", 0.0, 100.0), default=0.0,
                   help="0 = greedy")
    p.add_argument("--top-p", type=_float_in("--top-p", 0.0, 1.0, lo_open=True), default=1.0,
                   help="nucleus sampling mass (1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0 = off)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="weights and activations (auto: float32 on CPU, the checkpoint's dtype on GPU)")
    p.add_argument("--json", action="store_true", help="print one JSON object: token_ids, text, ...")


def cmd_make_tiny_model(args) -> int:
    from server.engine.tiny_model import make_tiny_model

    if args.hidden % args.heads:
        return _usage_error(f"--hidden ({args.hidden}) must be a multiple of --heads ({args.heads})")
    kv = args.kv_heads or args.heads
    if args.heads % kv:
        return _usage_error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({kv})")
    if args.vocab < 259:
        return _usage_error(f"--vocab must be >= 259 (3 special + 256 byte tokens), got {args.vocab}")
    path = make_tiny_model(
        args.out_dir, layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=kv,
        intermediate=args.intermediate, vocab=args.vocab, max_positions=args.max_positions,
        seed=args.seed, tie_word_embeddings=args.tie_word_embeddings,
    )
    print(path)
    return 0


def _usage_error(sentence: str) -> int:
    print(f"distserve: error: {sentence}", file=sys.stderr)
    return 2


def cmd_generate(args) -> int:
    from server.engine.llm_engine import EngineConfig, LLMEngine
    from server.engine.loader import load_tokenizer
    from server.engine.sampling_params import SamplingParams

    if args.top_k < 0:
        return _usage_error(f"--top-k must be >= 0, got {args.top_k}")
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos)
        engine = LLMEngine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype))
    except (ValueError, FileNotFoundError) as e:
        return _usage_error(str(e))
    tokenizer = load_tokenizer(engine.model_path)
    prompt_ids = args.prompt_ids if args.prompt_ids is not None else tokenizer.encode(args.prompt)
    try:
        [token_ids] = engine.generate([prompt_ids], params)
    except ValueError as e:
        return _usage_error(str(e))
    text = tokenizer.decode(token_ids)
    if args.json:
        print(json.dumps({"prompt_token_ids": prompt_ids, "token_ids": token_ids, "text": text}))
    else:
        print(text)
    return 0


def _add_sla(sub) -> None:
    p = sub.add_parser(
        "sla", add_help=False,
        help="SLA audits and compliance reports (distserve sla audit --help)",
        description="Example: distserve sla audit --spec configs/sla/default.yaml --results run.json --out report/",
    )
    p.add_argument("sla_args", nargs=argparse.REMAINDER)


def cmd_sla(args) -> int:
    # The one place `server` reaches into the harness: imported only when the command runs, so the
    # server never loads the harness packages (docs/ARCHITECTURE.md, dependency rule).
    from sla.cli import main as sla_main

    return sla_main(args.sla_args)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="distserve",
        description="LLM serving with prefill/decode disaggregation. Exit status: 0 ok, 1 failure, 2 bad "
                    "input (one sentence on stderr); a worker also exits 3 when the router refuses to register "
                    "it (wrong token or a different model). Example: distserve serve --model smollm2-135m-instruct",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("--log-level", type=str.upper, default=None,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="log level of this process and the processes it starts (default: INFO for serve, "
                             "router and worker, WARNING otherwise; env DISTSERVE_LOG_LEVEL)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_make_tiny_model(sub)
    _add_generate(sub)
    _add_sla(sub)
    from server.launcher import add_serve_parsers

    add_serve_parsers(sub)
    _add_harness_parsers(sub)
    return parser


def _add_harness_parsers(sub) -> None:
    """`chaos`, `doctor`, `gate`: the one edge from the server's CLI into the harness packages. The
    parsers are small and declared here; each handler imports chaos/ci lazily, so serving never loads
    them (see docs/ARCHITECTURE.md, dependency rule)."""
    def lazy(module: str, attr: str = "main"):
        def handler(args) -> int:
            import importlib
            return getattr(importlib.import_module(module), attr)(args)
        return handler

    from chaos.cli import (
        add_parser as add_chaos,  # argparse only: chaos/cli.py imports nothing else at load
    )
    add_chaos(sub)
    p = sub.add_parser("doctor", help="compare this host with the recommended baseline",
                       description="Checks the KV-link sysctls (net.core.rmem_max/wmem_max, net.ipv4.tcp_rmem/"
                                   "tcp_wmem), memory limits, prefill.max_seq_len against the model's context "
                                   "length and, given a router, the workers' registration; prints what drifted "
                                   "and the command that fixes it. Exit 1 on drift. Example: distserve doctor "
                                   "--router http://127.0.0.1:8080")
    p.add_argument("--config", default=None, help="YAML config (default: built-in defaults)")
    p.add_argument("--router", default=None, help="router URL: also check the workers' registration")
    p.add_argument("--netns", default=None, help="check the sysctls inside this network namespace")
    p.add_argument("--only", default=None, help="comma-separated subset of sysctl,memory,model,router (default: all)")
    p.add_argument("--sysctl-keys", default=None, help="check only these sysctl keys (comma-separated)")
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    p.set_defaults(handler=lazy("chaos.doctor"))
    p = sub.add_parser("gate", help="run the release-gate checklist and say go / no-go",
                       description="Runs ci/release_gate.yaml (tests, NaN lengths, TTFT P99 under load, drills, "
                                   "SLA audit) with a live checklist; writes gate.md and gate.json. Exit 1 on "
                                   "no-go. Example: distserve gate --quick --out .out/gate")
    p.add_argument("--checklist", default="ci/release_gate.yaml", help="default: ci/release_gate.yaml")
    p.add_argument("--quick", action="store_true", help="only the items marked quick, in their short form")
    p.add_argument("--out", default=".out/gate", help="report directory (default .out/gate)")
    p.add_argument("--only", default=None, help="comma-separated item ids to run")
    p.set_defaults(handler=lazy("ci.gate"))


COMMANDS = {"make-tiny-model": cmd_make_tiny_model, "generate": cmd_generate, "sla": cmd_sla}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "sla":  # `distserve sla --help` and options go to sla's own parser
        args.sla_args = extra + args.sla_args
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    level = args.log_level or os.environ.get(LOG_LEVEL_ENV) or (
        "INFO" if args.command in ("serve", "router", "worker") else "WARNING")
    os.environ[LOG_LEVEL_ENV] = level  # the children `serve` starts inherit it
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    handler = COMMANDS.get(args.command) or args.handler
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
