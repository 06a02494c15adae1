"""What every ``distserve`` command shares: the help formatter, the one usage-error rule (exit 2 with one
sentence on stderr), the config of ``--config`` plus flags, and the admin token."""

from __future__ import annotations

import argparse
import difflib
import os
import secrets
import sys
from typing import Literal, overload

from distserve.server.config import DistServeConfig, load_config
from distserve.server.launcher import TOKEN_ENV

LOG_LEVEL_ENV = "DISTSERVE_LOG_LEVEL"


class HelpWithDefaults(argparse.HelpFormatter):
    """Every option's help ends with its default, unless it says it already or has none worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            action.option_strings
            and "default" not in text
            and action.default not in (None, False)
            and action.default is not argparse.SUPPRESS
        ):
            text += " (default: %(default)s)"
        return text


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpWithDefaults)
        super().__init__(*args, **kwargs)


# Flags of the source article's commands (prefill_worker, decode_worker, router.py) that have no one-to-one
# counterpart here: what to do instead (docs/FROM_THE_ARTICLE.md has the whole mapping).
ARTICLE_FLAGS = {
    "--num-gpus": "one worker per GPU here: `serve --devices cuda:0,cuda:1 --prefill 1 --decode 1`, "
    "or one `distserve worker --role ROLE --router URL --device cuda:N` per GPU",
    "--prefill-host": "workers register with the router themselves: start each with "
    "`distserve worker --role prefill --router http://ROUTER:8080`",
    "--decode-host": "workers register with the router themselves: start each with "
    "`distserve worker --role decode --router http://ROUTER:8080`",
}


def unrecognized(parser: argparse.ArgumentParser, command: str | None, extra: list[str]) -> None:
    """Exit 2 with the subcommand's usage, naming the unknown option and the one it most likely meant."""
    sub = parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            sub = action.choices[command]
    known = [o for a in sub._actions for o in a.option_strings if o.startswith("--")]
    hints = []
    for word in extra:
        flag = word.split("=", 1)[0]
        if not flag.startswith("-"):
            continue
        if flag in ARTICLE_FLAGS:
            hints.append(f"{flag}: {ARTICLE_FLAGS[flag]}")
            continue
        close = closest_option(flag, known)
        if close:
            hints.append(f"did you mean {close}?")
    sub.error(f"unrecognized arguments: {' '.join(extra)}" + (f" ({'; '.join(hints)})" if hints else ""))


def closest_option(word: str, options: list[str]) -> str | None:
    """The option ``word`` is most likely a typo of: fewest edits (a swap of two neighbours is one edit, so
    --modle is --model, not --mode), then the same length, then difflib's similarity; None when far."""

    def edits(a: str, b: str) -> int:  # optimal string alignment distance
        d = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
        for i in range(1, len(a) + 1):
            for j in range(1, len(b) + 1):
                d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] != b[j - 1]))
                if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                    d[i][j] = min(d[i][j], d[i - 2][j - 2] + 1)
        return d[-1][-1]

    scored = sorted(
        (edits(word, o), abs(len(o) - len(word)), -difflib.SequenceMatcher(None, word, o).ratio(), o) for o in options
    )
    if not scored or scored[0][0] > max(2, len(word) // 3):
        return None
    return scored[0][3]


def usage_error(sentence: str) -> int:
    print(f"distserve: error: {sentence}", file=sys.stderr)
    return 2


def load_args_config(args) -> DistServeConfig:
    """``--config`` with the command's flags (``--model``, ``--port``, ``--host``) merged over it."""
    overrides: dict = {}
    if getattr(args, "model", None):
        overrides["model"] = args.model
    router: dict = {}
    if getattr(args, "port", None) is not None:
        router["port"] = args.port
    if getattr(args, "host", None):
        router["host"] = args.host
    if router:
        overrides["router"] = router
    return load_config(args.config, overrides)


@overload
def admin_token(cfg: DistServeConfig, generate: Literal[True]) -> str: ...
@overload
def admin_token(cfg: DistServeConfig, generate: bool) -> str | None: ...
def admin_token(cfg: DistServeConfig, generate: bool) -> str | None:
    tok = os.environ.get(TOKEN_ENV) or cfg.router.admin_token
    if not tok and generate:
        tok = secrets.token_hex(16)
    return tok
