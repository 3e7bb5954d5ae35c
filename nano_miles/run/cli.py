"""How every entry point meets a user's mistake: one line on stderr and exit status 2, never a traceback.

Library module: each `python -m` entry point parses its flags with `ArgumentParser` and ends with
`run(main, "name")`. A bad flag, a config value out of range and a plug-in that does not import all
raise `UserError` wherever they are found, and `run` alone turns it into `name: message`.
Standard library only: entry points import this before anything heavy.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

EXIT_USAGE = 2  # what argparse and the shell use for a usage error


class UserError(Exception):
    """What the user asked for cannot be done; the message names the flag, key or value, and what is allowed."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the module docstring kept as written, and a bad flag raised as a UserError
    (argparse itself would print the usage and the error: several lines)."""

    def __init__(self, *args, formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)

    def error(self, message: str):
        raise UserError(message)


def run(main: Callable[[list[str]], int | None], name: str) -> None:
    """sys.exit(main(argv)); a UserError from anywhere in `main` ends as one line `name: message`
    on stderr and exit status 2. Any other exception is a bug and keeps its traceback."""
    try:
        code = main(sys.argv[1:])
    except UserError as e:
        print(f"{name}: {e}", file=sys.stderr)
        code = EXIT_USAGE
    sys.exit(code)
