"""What every pipeline process sets up the same way: logging, the run directory, signals, threads.

Library module called first by each stage's entry point (`procs/<stage>.py`).

A SIGTERM (supervisord stopping the stage or the run, or a plain `kill`) ends a stage with
EXIT_STOPPED, never 0, which means "finished" (the trainer's run is done, an unused engine slot idle)
and is not restarted. The trainer's own handler stops at a safe point (`Trainer.request_stop`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from pathlib import Path

from nano_miles.run import liveness
from nano_miles.run.config import Config

PR_SET_PDEATHSIG = 1
EXIT_STOPPED = 128 + signal.SIGTERM  # what a shell reports for a process ended by SIGTERM


class StopRequested(Exception):
    """A SIGTERM reached a stage that stops only where stopping loses nothing (the trainer)."""


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask Linux to signal this process when its parent (supervisord) dies: no orphans. Each entry
    point calls it first; it holds across exec (the engine slot execs its server)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)


def processes_of_run(run_dir: Path) -> dict[int, list[str]]:
    """pid -> argv of every other process started for `run_dir` (supervisord.conf puts
    NANOMILES_RUN_DIR in every program's environment, and their children inherit it); empty without /proc."""
    marker, found = f"NANOMILES_RUN_DIR={run_dir}".encode(), {}
    for proc in Path("/proc").glob("[0-9]*"):
        if int(proc.name) == os.getpid():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:  # gone meanwhile, or another user's
            continue
        if marker in environ:
            found[int(proc.name)] = argv
    return found


def setup_process(name: str, cfg: Config, *, num_threads: int | None = None,
                  is_log_copied: bool = False) -> logging.Logger:
    """Logging to stderr (supervisord files it), run dir, thread count; `is_log_copied` also
    writes the log to <run dir>/<name>.log (for a stage whose stderr goes to the terminal)."""
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    liveness.start(cfg.run_dir, name)
    handlers = [logging.StreamHandler(sys.stderr)]
    if is_log_copied:
        handlers.append(logging.FileHandler(cfg.run_dir / f"{name}.log"))
    logging.basicConfig(level=logging.INFO, handlers=handlers,
                        format=f"%(asctime)s {name} %(levelname)s %(message)s", datefmt="%H:%M:%S")
    if cfg.security.curve_dir:
        from nano_miles.wire.sockets import use_curve
        use_curve(cfg.security.curve_dir)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(EXIT_STOPPED))  # run finally-blocks, close sockets
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # no progress bars in stage logs
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # model paths are local directories, never a hub
    import transformers
    transformers.utils.logging.disable_progress_bar()
    if num_threads is not None:
        import torch
        torch.set_num_threads(num_threads)
    return logging.getLogger(name)
