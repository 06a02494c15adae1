"""Subcommands beyond ``run``: sweep, compare, plot, merge, demo (each in its own module)."""

from __future__ import annotations


def add_parsers(sub, formatter, add_load_args) -> None:
    from distbench import demo

    demo.add_parser(sub, formatter)
