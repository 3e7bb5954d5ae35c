"""Makes the run directory fresh for a new run: an earlier run moves aside, a live one is left alone.

Run: python -m nano_miles.run.fresh [RUN_DIR]   (default runs/current; `make run` runs it first)

An earlier run (anything in the directory but `.gitkeep`) moves to `<parent>/<its time>`, so its
checkpoints, logs and summary stay. A run whose supervisord is still up (its control socket,
`supervisor.sock` in the directory, takes a connection) is refused in one line, exit 2: moving it
would pull the directory from under its live stages, and their shutdown would then remove the new
run's socket.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

from nano_miles.run.cli import ArgumentParser, UserError, run

SOCKET = "supervisor.sock"  # supervisord.conf's [unix_http_server] file, in the run directory
KEEP = ".gitkeep"           # the empty runs/current of a checkout


def is_live(run_dir: Path) -> bool:
    """Does a supervisord answer on the run directory's control socket? (A socket file left by a
    supervisord that was killed takes no connection.)"""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(2.0)
        try:
            s.connect(str(run_dir / SOCKET))
            return True
        except OSError:
            return False


def make_fresh(run_dir: Path) -> Path | None:
    """Move an earlier run in `run_dir` aside (to a sibling named by the time); where it went, or
    None if there was none. A UserError if the run there is live."""
    if is_live(run_dir):
        raise UserError(f"{run_dir} holds a live run (its supervisord answers on {run_dir / SOCKET}): "
                        f"stop it first (supervisorctl -c supervisord.conf shutdown) or pass another directory")
    if not run_dir.is_dir() or not [p for p in run_dir.iterdir() if p.name != KEEP]:
        run_dir.mkdir(parents=True, exist_ok=True)
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = run_dir.parent / stamp
    for i in range(1, 100):  # two moves within a second
        if not aside.exists():
            break
        aside = run_dir.parent / f"{stamp}-{i}"
    run_dir.rename(aside)
    run_dir.mkdir()
    (run_dir / KEEP).touch()
    return aside


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="python -m nano_miles.run.fresh", description=__doc__)
    parser.add_argument("run_dir", nargs="?", type=Path, default=Path("runs/current"), help="the run directory")
    args = parser.parse_args(argv)
    if args.run_dir.exists() and not args.run_dir.is_dir():
        raise UserError(f"{args.run_dir} is not a directory (a run directory, e.g. runs/current)")
    aside = make_fresh(args.run_dir)
    if aside is not None:
        print(f"the earlier run in {args.run_dir} moved to {aside}")
    return 0


if __name__ == "__main__":
    run(main, "fresh")
