"""How every entry point meets a user's mistake: one line on stderr and exit status 2, never a traceback.

Library module: each `python -m` entry point parses its flags with `ArgumentParser` and ends with
`run(main, "name")`. A bad flag, a config value out of range and a plug-in that does not import all
raise `UserError` wherever they are found, and `run` alone turns it into `name: message`.
A stage's last line (the error, or a crash's exception) ends its log in the run directory, where the
run's watch quotes it in FAILED (`nano_miles/run/watch.py`); a stage whose stderr goes elsewhere (the
trainer's goes to the terminal) has it appended there.
Standard library only: entry points import this before anything heavy.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

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


def keep_last_line(name: str, line: str) -> None:
    """Under supervisord, end `<run dir>/<name>.log` with `line`: the log a stage writes itself because
    its stderr goes elsewhere (`setup_process(..., is_log_copied=True)`; the trainer's goes to the
    terminal). Other stages' stderr is their log already."""
    run_dir = os.environ.get("NANOMILES_RUN_DIR")  # supervisord.conf sets it for every program
    if not run_dir:
        return
    try:
        with (Path(run_dir) / f"{name}.log").open("a") as f:
            f.write(line + "\n")
    except OSError:  # no run directory (moved away, a full disk): stderr has the line
        pass


def run(main: Callable[[list[str]], int | None], name: str, *, is_log_copied: bool = False,
        is_hard_exit: bool = False) -> None:
    """sys.exit(main(argv)); a UserError from anywhere in `main` ends as one line `name: message`
    on stderr and exit status 2. Any other exception is a bug and keeps its traceback (exit 1).
    `is_log_copied`: the process keeps its own log in the run directory, which gets the line too.
    `is_hard_exit`: leave without the interpreter's teardown (a rank of a sharded trainer: gloo's
    destructors abort now and then at exit, which would replace the exit status)."""
    last = None
    try:
        code = main(sys.argv[1:])
    except UserError as e:
        last = f"{name}: {e}"
        print(last, file=sys.stderr)
        code = EXIT_USAGE
    except Exception as e:
        traceback.print_exc()
        last = f"{name}: crashed: {type(e).__name__}: {e}"
        code = 1
    if last is not None and is_log_copied:
        keep_last_line(name, last)
    if is_hard_exit:
        import logging
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)
    sys.exit(code)
