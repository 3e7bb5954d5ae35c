"""Liveness: each stage's main loop leaves a heartbeat; the run's watch restarts a stage that stops beating.

Library module. A stage calls `start(run_dir, stage)` once (in `setup_process`) and `beat()` from its
main loop and from every loop that waits on a peer (a stage waiting for its engine or its producer is
alive, not hung). `beat` writes `<run dir>/heartbeat/<stage>.json` at most once a second: the pid, the
time and what the stage waits for. The beat comes only from the loop itself, never from a helper
thread, so a stage that is stopped (SIGSTOP), deadlocked or stuck in a call stops beating;
the run's listener (`procs/run_end.py`, `nano_miles/run/watch.py`) restarts it after `run.hang_timeout_s` through supervisord.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

HEARTBEAT_DIR = "heartbeat"
BEAT_EVERY_S = 1.0  # a file write per second per stage: cheap, and far finer than any hang timeout

_path: Path | None = None
_last_s = 0.0


def heartbeat_path(run_dir: Path, stage: str) -> Path:
    return run_dir / HEARTBEAT_DIR / f"{stage}.json"


def start(run_dir: Path, stage: str) -> None:
    """Beat for `stage` from now on (the first beat is written at once)."""
    global _path, _last_s
    _path, _last_s = heartbeat_path(run_dir, stage), 0.0
    _path.parent.mkdir(parents=True, exist_ok=True)
    beat("starting")


def beat(waiting_for: str = "") -> None:
    """Say this process's loop is running; a no-op outside a stage (tests, tools) or within a second."""
    global _last_s
    now = time.time()
    if _path is None or now - _last_s < BEAT_EVERY_S:
        return
    _last_s = now
    tmp = _path.with_suffix(".tmp")
    # the pid supervisord knows the stage by: a sharded trainer's rank 0 beats for its launcher
    pid = int(os.environ.get("NANOMILES_STAGE_PID", os.getpid()))
    tmp.write_text(json.dumps({"pid": pid, "time": now, "waiting_for": waiting_for}))
    os.replace(tmp, _path)


def read_heartbeat(run_dir: Path, stage: str) -> dict | None:
    try:
        return json.loads(heartbeat_path(run_dir, stage).read_text())
    except (OSError, ValueError):
        return None
