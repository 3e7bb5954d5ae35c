"""The trainer's durable state: atomic checkpoints (HF weights in safetensors + optimizer + ledger).

Library module used by the trainer; `tests/test_chaos.py` kills the trainer around its saves and resumes from them.

A checkpoint is a directory `checkpoints/step_NNNNNN/` holding the model (save_pretrained:
config.json + model.safetensors) and `trainer_state.pt` (optimizer state, step, weight version, data
cursor, and which groups each step trained). It is written under a `.tmp` name, every file and the
directory are fsynced, and only then is it renamed into place: a reader sees a whole checkpoint or
none. The newest complete one wins at start; leftover `.tmp` directories are debris of a crash.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nano_miles.weights.named_tensors import load_safetensors_dir

STATE_FILE = "trainer_state.pt"
KEEP_LAST = 2  # older complete checkpoints are deleted after a new one lands


@dataclass
class TrainerState:
    step: int = 0
    version: int = 0
    cursor: int = 0                                             # one past the furthest group seen
    trained_by_step: dict[int, list[str]] = field(default_factory=dict)
    evals: list[list] = field(default_factory=list)             # [step, held-out accuracy, elapsed s]
    elapsed_s: float = 0.0                                      # training wall time so far

    @property
    def trained_ids(self) -> set[str]:
        return {g for ids in self.trained_by_step.values() for g in ids}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(path)


def save_checkpoint(root: Path, model, optimizer, state: TrainerState) -> Path:
    final = root / f"step_{state.step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    torch.save({"optimizer": optimizer.state_dict(), "step": state.step, "version": state.version,
                "cursor": state.cursor, "trained_by_step": state.trained_by_step, "evals": state.evals,
                "elapsed_s": state.elapsed_s}, tmp / STATE_FILE)
    _fsync_tree(tmp)
    if final.exists():  # the same step saved again after a restart: replace it whole
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)  # the rename itself; the files were synced before it
    for old in complete_checkpoints(root)[:-KEEP_LAST]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoint directories, oldest first."""
    if not root.exists():
        return []
    return sorted(p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")
                  and (p / STATE_FILE).exists())


def load_checkpoint(path: Path, model, optimizer) -> TrainerState:
    """Load weights and optimizer state into the given objects; return the counters."""
    load_safetensors_dir(model, str(path))
    saved = torch.load(path / STATE_FILE, weights_only=True)
    optimizer.load_state_dict(saved["optimizer"])
    return TrainerState(step=saved["step"], version=saved["version"], cursor=saved["cursor"],
                        trained_by_step={int(k): list(v) for k, v in saved["trained_by_step"].items()},
                        evals=[list(e) for e in saved["evals"]], elapsed_s=float(saved["elapsed_s"]))
