"""What every ``distserve`` command shares: the help formatter, the one usage-error rule (exit 2 with one
sentence on stderr), the config of ``--config`` plus flags, and the admin token."""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from typing import Literal, overload

from server.config import DistServeConfig, load_config
from server.launcher import TOKEN_ENV

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
