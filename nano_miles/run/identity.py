"""The run's identity: a random id and a start time, drawn by the trainer when the run starts.

Library module. The trainer writes `<run dir>/run.json` at its first start and keeps both values in
every checkpoint; a restarted trainer takes them from its checkpoint (or from this file before the
first checkpoint). The id tags every data and control message, so stages of another run (a leftover
process, a second run on the same ports) are refused; the start time makes the run's wall time span
restarts. A run is also the train split its group ids number: a checkpoint keeps it, and a trainer
started on it under another split refuses (`refuse_another_split`).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

from nano_miles.run.cli import UserError

RUN_FILE = "run.json"
FINISHED_FILE = "summary.json"  # the trainer writes it once the run's last step is done


def refuse_a_finished_run(run_dir: Path) -> None:
    """A run directory that holds a finished run takes no new one: a UserError, one line. (Starting
    supervisord there again would otherwise resume a run that has nothing left to do.)"""
    if (run_dir / FINISHED_FILE).is_file():
        found = read_run_identity(run_dir)
        run = f"the finished run {found[0]}" if found else "a finished run"
        raise UserError(f"{run_dir} holds {run} (its {FINISHED_FILE} is there): move it aside "
                        "(`make run` does) or pass another --run.dir")


def refuse_another_split(recorded: dict, current: dict, checkpoint: Path) -> None:
    """A UserError, one line, when `checkpoint` was made under another train split than `current` (both
    `nano_miles.tasks.split_identity`): its data cursor and ledger are positions in its own split, which
    under another one name other prompts. Named: each setting that differs, old and new. A checkpoint
    made before splits were recorded (`recorded` empty) is taken as it is."""
    if not recorded or (recorded["num_items"], recorded["sha256"]) == (current["num_items"], current["sha256"]):
        return
    old, new = recorded["settings"], current["settings"]
    changed = [f"{key} is {new.get(key)!r}, {checkpoint} was made with {old.get(key)!r}"
               for key in sorted(old.keys() | new.keys()) if old.get(key) != new.get(key)]
    what = "; ".join(changed) or (
        f"the train split's problems changed under the same settings ({current['num_items']}, sha256 "
        f"{current['sha256'][:12]}; {checkpoint} was made with {recorded['num_items']}, {recorded['sha256'][:12]})")
    raise UserError(f"{what}: its group ids, data cursor and ledger are positions in that train split; go back "
                    f"to it, or start a new run from its weights (--model.path={checkpoint} and another --run.dir)")


def read_run_identity(run_dir: Path) -> tuple[str, float] | None:
    """(run id, unix start time) of the run in `run_dir`, or None before its trainer first started."""
    try:
        data = json.loads((run_dir / RUN_FILE).read_text())
        return str(data["run_id"]), float(data["started_at"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def ensure_run_identity(run_dir: Path) -> tuple[str, float]:
    """The run's identity, drawn and written (atomically) if this is the run's first start."""
    found = read_run_identity(run_dir)
    if found is not None:
        return found
    return write_run_identity(run_dir, uuid.uuid4().hex[:12], time.time())


def write_run_identity(run_dir: Path, run_id: str, started_at: float) -> tuple[str, float]:
    """Record (atomically) that `run_dir` holds the run `run_id`: a new one, or one continued from
    another directory's checkpoint (`trainer.resume_from`)."""
    tmp = run_dir / (RUN_FILE + ".tmp")
    tmp.write_text(json.dumps({"run_id": run_id, "started_at": started_at}) + "\n")
    os.replace(tmp, run_dir / RUN_FILE)
    return run_id, started_at
