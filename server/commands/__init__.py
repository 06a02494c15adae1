"""The ``distserve`` subcommands, one module per family; ``server/cli.py`` builds the parser and dispatches.

Every subcommand registers its parser with ``set_defaults(handler=...)`` and returns an exit status:
0 ok, 1 failure at run time, 2 bad input (``common.usage_error``: one sentence on stderr).
"""
