"""The trainer's durable state: atomic, verifiable checkpoints (HF weights + optimizer + ledger).

Library module used by the trainer; `tests/test_chaos.py` kills the trainer around its saves and resumes
from them, `tests/test_checkpoint.py` damages them.

A checkpoint is a directory `checkpoints/step_NNNNNN/` holding a complete Hugging Face model
directory (config.json, model.safetensors, generation_config.json, the tokenizer files and chat
template), so `from_pretrained` and `sglang.launch_server --model-path` take it as it is,
`python -m nano_miles.export` copies it out without the trainer's files; then `trainer_state.pt` (the
optimizer's and the learning-rate schedule's state, step, weight version, data cursor, which groups
each step trained or skipped, the run's identity, the train split's and token counts) and, written last,
`manifest.json`: the size and SHA-256 of every other file. It is written under a `.tmp` name, every
file and the directory are fsynced, and only then is it renamed into place.

A sharded trainer (`trainer.strategy = "fsdp2"`, `sharded.py`) writes the same model directory from
one gather on rank 0, and the optimizer's state as an `optimizer` folder: torch.distributed.checkpoint's files,
one per rank, which load into any number of ranks, one plain process included; its trainer_state.pt
then holds no optimizer state. A one-process checkpoint loads into a sharded trainer too.

A LoRA run's checkpoint holds PEFT's adapter directory (adapter_config.json, adapter_model.safetensors)
instead of the model's weights, and `lora_base.json`: the base model's path and SHA-256, checked again
at every load (`lora.py`).

A checkpoint counts only if its manifest verifies. A rename makes a crash during a save harmless, but
not a disk that loses or truncates files later, or a copy cut short: `load_newest` skips such a
checkpoint with a warning naming it and falls back to the next older one, so a damaged newest
checkpoint costs a few steps instead of a trainer that dies at every start.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

from nano_miles.run.cli import UserError
from nano_miles.stages.trainer.lora import load_adapters
from nano_miles.stages.trainer.memory_plan import GIB
from nano_miles.weights.named_tensors import WeightUpdateError, has_adapters, load_safetensors_dir

log = logging.getLogger("trainer")

STATE_FILE = "trainer_state.pt"
BASE_FILE = "lora_base.json"  # a LoRA checkpoint's: the base model its adapters were trained on (path, SHA-256)
MANIFEST = "manifest.json"
OPTIMIZER_DIR = "optimizer"  # a sharded trainer's optimizer state, each rank's part (torch.distributed.checkpoint)
TRAINER_FILES = (STATE_FILE, MANIFEST, BASE_FILE, OPTIMIZER_DIR)  # what a checkpoint holds beyond the HF model directory
KEEP_LAST = 2  # older complete checkpoints are deleted after a new one lands
FILES_BYTES = 64 * 2**20  # a checkpoint's files beside its tensors: the tokenizer's (11 MB for Qwen2.5's), the ledger
DISK_MARGIN = 1.02  # the file system's own


@dataclass
class TrainerState:
    step: int = 0
    version: int = 0
    cursor: int = 0                                             # one past the furthest group trained
    trained_by_step: dict[int, list[str]] = field(default_factory=dict)
    no_signal_ids: set[str] = field(default_factory=set)        # consumed untrained: all rewards equal
    evals: list[dict] = field(default_factory=list)             # every evaluation, `EvalResult.as_dict`
    run_id: str = ""                                            # the run these steps belong to
    started_at: float = 0.0                                     # unix time the run started
    num_trained_tokens: int = 0                                 # response tokens in the model (goodput)
    num_generated_tokens: int = 0                               # the producer's count at its last reply
    split: dict = field(default_factory=dict)                   # `nano_miles.tasks.split_identity`

    @property
    def trained_ids(self) -> set[str]:
        return {g for ids in self.trained_by_step.values() for g in ids}

    def saved(self) -> dict:
        """Every field, as trainer_state.pt keeps it beside the learner's state."""
        return {**asdict(self), "no_signal_ids": sorted(self.no_signal_ids)}

    @classmethod
    def from_saved(cls, saved: dict) -> "TrainerState":
        saved = {"split": {}, **saved}  # written before the split was recorded: unknown, not compared
        values = {f.name: saved[f.name] for f in fields(cls)}
        return cls(**{**values, "trained_by_step": {int(k): list(v) for k, v in values["trained_by_step"].items()},
                      "no_signal_ids": set(values["no_signal_ids"]), "started_at": float(values["started_at"]),
                      "evals": [eval_entry(e) for e in values["evals"]]})


def eval_entry(saved) -> dict:
    """An evaluation as kept in a checkpoint; those written before evaluations were named are the
    positional rows [step, accuracy, elapsed s, reward, pass@k]."""
    if isinstance(saved, dict):
        return saved
    return {**dict(zip(("step", "accuracy", "elapsed_s", "reward", "pass_at_k"), saved)), "k": 0, "parts": {}}


class DamagedCheckpoint(RuntimeError):
    """A checkpoint whose files do not match its manifest (or that has none)."""


class OlderCheckpoint(RuntimeError):
    """A checkpoint whose trainer state lacks what this trainer continues from (an older format)."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _write_manifest(directory: Path) -> None:
    files = {p.relative_to(directory).as_posix(): {"size": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(directory.rglob("*")) if p.is_file()}
    (directory / MANIFEST).write_text(json.dumps({"files": files}, indent=1))


def verify(directory: Path, *, checksums: bool = True) -> None:
    """Raise DamagedCheckpoint unless every file the manifest lists is there with its size (and hash)."""
    try:
        files = json.loads((directory / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DamagedCheckpoint(f"{directory.name}: no readable {MANIFEST} ({e})") from None
    for name, expected in files.items():
        path = directory / name
        if not path.is_file() or path.stat().st_size != expected["size"]:
            size = path.stat().st_size if path.is_file() else "missing"
            raise DamagedCheckpoint(f"{directory.name}: {name} is {size} bytes, "
                                    f"the manifest says {expected['size']}")
        if checksums and _sha256(path) != expected["sha256"]:
            raise DamagedCheckpoint(f"{directory.name}: {name} does not match its SHA-256 in the manifest")


def save_checkpoint(root: Path, model, tokenizer, learner, state: TrainerState, base: dict | None = None, *,
                    save=None) -> Path:
    """`learner`: what holds the optimizer and the schedule (`learner.Learner`; its `state_dict`);
    `base`: a LoRA model's base (`lora.base_identity`), which the checkpoint names instead of holding;
    `save(directory) -> learner state`: writes the model's files when every rank takes part
    (`sharded.Work.save`), instead of `save_pretrained` here."""
    final = root / f"step_{state.step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    refuse_a_short_disk(root, model, 1)  # the disk may have filled since the trainer started
    tmp.mkdir(parents=True)
    try:
        kept = save_model(tmp, model, learner) if save is None else save(tmp)
        tokenizer.save_pretrained(tmp)  # the model directory is whole: it loads and encodes anywhere
        torch.save({**kept, **state.saved()}, tmp / STATE_FILE)
        if base:
            (tmp / BASE_FILE).write_text(json.dumps(base))
        _write_manifest(tmp)  # last: its presence says every file before it was written whole
        for p in tmp.rglob("*"):
            if p.is_file():
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
            else:
                _fsync_dir(p)
        _fsync_dir(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a part of a checkpoint only takes space
        raise
    if final.exists():  # the same step saved again after a restart: replace it whole
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)  # the rename itself; the files were synced before it
    for old in complete_checkpoints(root)[:-KEEP_LAST]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def checkpoint_bytes(model) -> int:
    """At most what one checkpoint of `model` takes on disk: the model's weights (a LoRA model's: its
    adapters) and AdamW's two moments of every trained parameter, each in the parameter's dtype (a full
    fine-tune of 3.1 B fp32 parameters: 12 GB of weights and 25 GB of AdamW state), and FILES_BYTES. A
    sharded model's parameters count whole: rank 0 writes the gathered weights, the ranks the optimizer's shards."""
    def size(params) -> int:
        return sum(p.numel() * p.element_size() for p in params)
    trained = [p for p in model.parameters() if p.requires_grad]
    return size(trained if has_adapters(model) else model.parameters()) + 2 * size(trained) + FILES_BYTES


def num_saves(step: int, trainer) -> int:
    """How many checkpoints the steps after `step` write: every `trainer.checkpoint_every`-th one and the
    last (`trainer`: the config's section)."""
    num_steps, every = trainer.num_steps, trainer.checkpoint_every
    if step >= num_steps:
        return 0
    periodic = (num_steps // every - step // every) if every > 0 else 0
    return periodic + (0 if every > 0 and num_steps % every == 0 else 1)


def refuse_a_short_disk(root: Path, model, saves: int) -> str:
    """Refuse (UserError) when the disk under `root` cannot hold the `saves` checkpoints to come: up to
    KEEP_LAST kept and one being written at once, beside those there now. Found by a failing save
    instead, a full disk would cost the steps since the last checkpoint at every restart; this way the
    run ends with one line and its checkpoints as they are. Returns what it found, for the log."""
    each = checkpoint_bytes(model)
    kept = len(complete_checkpoints(root))
    at_once = max(0, min(KEEP_LAST + 1, kept + saves) - kept)
    free = shutil.disk_usage(next(p for p in (root, *root.parents) if p.exists())).free
    if free < at_once * each * DISK_MARGIN:
        needs = "this run's checkpoints need" if at_once > 1 else "a checkpoint needs"
        raise UserError(f"{needs} about "
                        f"{at_once * each * DISK_MARGIN / GIB:.1f} GiB in {root} ({at_once} at once of "
                        f"{each / GIB:.1f} GiB: the model's weights and AdamW's state), and {free / GIB:.1f} GiB "
                        "are free there; free some space (the run resumes from its newest checkpoint) or set "
                        "run.dir on a larger disk")
    return (f"checkpoints: about {each / GIB:.1f} GiB each, {saves} to come, {at_once} more at once on disk; "
            f"{free / GIB:.1f} GiB free in {root}")


def _checkpoint_dirs(root: Path) -> list[Path]:
    """Every checkpoint directory, whole or damaged, oldest first (`.tmp` ones are debris of a crash)."""
    if not root.exists():
        return []
    return sorted(p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))


def complete_checkpoints(root: Path) -> list[Path]:
    """Checkpoint directories whose manifest lists files of the right sizes, oldest first (cheap:
    the checksums are read only for the one that is loaded)."""
    complete = []
    for p in _checkpoint_dirs(root):
        try:
            verify(p, checksums=False)
            complete.append(p)
        except DamagedCheckpoint:
            pass
    return complete


def load_newest(root: Path, model, learner, base: dict | None = None, *,
                load=None) -> tuple[Path, TrainerState] | None:
    """Load the newest checkpoint that verifies in full; damaged ones are skipped with a warning.
    `load` as in `load_checkpoint`."""
    for path in reversed(_checkpoint_dirs(root)):
        try:
            verify(path)
            return path, load_checkpoint(path, model, learner, base, load=load)
        except (DamagedCheckpoint, OSError, RuntimeError, ValueError, KeyError) as e:
            log.warning("skipping checkpoint %s: %s", path, e)
    return None


def find_checkpoint(path: Path, what: str) -> Path:
    """`path` itself if it is a checkpoint that verifies, else the newest complete checkpoint of the
    run directory `path`; a UserError naming `what` (the key or argument) if there is none."""
    if (path / STATE_FILE).is_file():
        try:
            verify(path)
        except DamagedCheckpoint as e:
            raise UserError(f"{what} {str(path)!r} does not verify: {e}") from None
        return path
    if not (path / "checkpoints").is_dir():
        raise UserError(f"{what} {str(path)!r} is neither a checkpoint (no {STATE_FILE}) nor a run directory "
                        "with checkpoints/")
    for candidate in reversed(complete_checkpoints(path / "checkpoints")):
        try:
            verify(candidate)
            return candidate
        except DamagedCheckpoint as e:
            log.warning("skipping checkpoint %s: %s", candidate, e)
    raise UserError(f"{what} {str(path)!r} holds no checkpoint that verifies")


def load_resume_from(path: Path, model, learner, base: dict | None = None, *,
                     load=None) -> tuple[Path, TrainerState]:
    """The checkpoint `trainer.resume_from` names, loaded (see `find_checkpoint`); one of an older
    format, or of another model, is a UserError naming it."""
    found = find_checkpoint(path, "trainer.resume_from")
    try:
        return found, load_checkpoint(found, model, learner, base, load=load)
    except OlderCheckpoint as e:
        raise UserError(f"trainer.resume_from {str(found)!r}: {e}; its weights alone can start a new run: "
                        f"--model.path={found}") from None
    except WeightUpdateError as e:
        raise UserError(f"trainer.resume_from {str(found)!r} does not fit model.path ({e})") from None


def lora_base(path: Path) -> dict | None:
    """The base model a LoRA checkpoint's adapters were trained on (path, SHA-256); None for a full model."""
    return json.loads((path / BASE_FILE).read_text()) if (path / BASE_FILE).is_file() else None


def load_checkpoint(path: Path, model, learner, base: dict | None = None, *, load=None) -> TrainerState:
    """Load weights (a LoRA model's: its adapters, onto the `base` the checkpoint names), optimizer and
    schedule state into the given objects; return the counters. The state is read and checked first:
    one this trainer cannot continue leaves the model untouched. `load(path, saved)`: loads them when
    every rank takes part (`sharded.Work.load`), instead of `load_model` here."""
    saved = torch.load(path / STATE_FILE, weights_only=True)
    has_shards = (path / OPTIMIZER_DIR).is_dir()  # the optimizer's state is there, not in the state file
    missing = [k for k in (*learner.state_dict(), *(f.name for f in fields(TrainerState)))
               if k not in saved and not (k == "optimizer" and has_shards)]
    if missing:
        raise OlderCheckpoint(f"written by an older nano-miles: its {STATE_FILE} has no {', '.join(missing)}")
    named = lora_base(path)
    if bool(named) != bool(base):
        raise WeightUpdateError("it holds LoRA adapters and the trainer trains the whole model (set trainer.lora_rank)"
                                if named else "it holds a whole model and the trainer trains LoRA adapters")
    if base and named["sha256"] != base["sha256"]:
        raise WeightUpdateError(f"its adapters were trained on the base model {named['path']} "
                                f"(SHA-256 {named['sha256'][:12]}), not this one ({base['path']}, {base['sha256'][:12]})")
    if load is None:
        load_model(path, model, learner, saved, base)
    else:
        load(path, saved)
    return TrainerState.from_saved(saved)


def save_model(directory: Path, model, learner) -> dict:
    """One process: the model's files (a LoRA model's: its adapter directory) into `directory`; the
    learner's state for the trainer state file."""
    model.save_pretrained(directory)
    return learner.state_dict()


def load_model(directory: Path, model, learner, saved: dict, base: dict | None) -> None:
    """One process: a checkpoint's weights (a LoRA model's adapters) and the learner's state (`saved`:
    its trainer state file, read already)."""
    if base:
        load_adapters(model, directory)
    else:
        load_safetensors_dir(model, str(directory))
    learner.load_state_dict(saved, directory)
