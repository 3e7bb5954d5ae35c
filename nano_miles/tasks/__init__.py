"""Tasks: problem sets, plugged in by dotted path (`task.name`); how their prompts become ids is `prompts.py`.
Used as a library: `load_problems(load_config(), "train")`.

A task module provides `load_split(cfg, split)`: every problem of the split ("train" or "test") in
the run's order, each a `Problem` with a `prompt` (text, or a list of chat messages) and an
`answer` (the label the reward function compares with). `load_problems` takes the first
`task.num_train` / `task.num_test` of them (0 = all), so group ids, which are positions in that
order, mean the same problem in every process and after every restart. A stage loads its task
first thing: one that does not import, that has an empty split, or that is smaller than the user
asked for, is a UserError naming the key; a checkpoint keeps the train split's `split_identity`, and a
restart under another split is refused. Built in: `nano_miles.tasks.arithmetic` (the default run) and
`nano_miles.tasks.files` (a user's JSONL / Parquet / datasets file).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import logging
from dataclasses import dataclass

from nano_miles.run.cli import UserError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Problem:
    prompt: str | tuple  # text for a user turn, or chat messages ({"role", "content"} dicts)
    answer: str          # the label handed to the reward function
    fields: dict = dataclasses.field(default_factory=dict, compare=False)  # the record's other keys, for
                         # a reward function of the (prompt, response, label, **fields) form


def load_task(name: str):
    """The task module named by `task.name`; a UserError naming it if it does not import or lacks
    `load_split`."""
    try:
        task = importlib.import_module(name)
    except ImportError as e:
        raise UserError(f"task.name {name!r}: cannot import it ({e})") from None
    if not callable(getattr(task, "load_split", None)):
        raise UserError(f"task.name {name!r}: a task module provides load_split(cfg, split); this one does not")
    return task


def load_problems(cfg, split: str) -> list[Problem]:
    """The first task.num_<split> problems of the split (0 = all of them). An empty split is a
    UserError: the trainer evaluates the test split at least once, at the end (`trainer.eval_every`).
    A split smaller than the number asked for is a UserError naming both if the user set it; left at
    its default, the split is taken whole and a warning says so in one line."""
    problems = list(load_task(cfg.task.name).load_split(cfg, split))
    key, num = f"task.num_{split}", {"train": cfg.task.num_train, "test": cfg.task.num_test}[split]
    if not problems:
        raise UserError(f"the {split} split of {cfg.task.name} is empty: the trainer "
                        f"{'trains on' if split == 'train' else 'evaluates'} it")
    if num > len(problems):
        if cfg.is_set(key):
            raise UserError(f"{key} is {num}, but the {split} split of {cfg.task.name} holds {len(problems)} "
                            f"problems: set at most {len(problems)}, or 0 to take them all")
        log.warning("%s is %d by default, but the %s split of %s holds %d problems: using all %d", key, num,
                    split, cfg.task.name, len(problems), len(problems))
        num = 0
    return problems[:num] if num else problems


def split_identity(cfg, problems: list[Problem]) -> dict:
    """What makes group ids name these problems, as a checkpoint keeps it: the split's size, a SHA-256 of
    its problems in order, and the settings that chose them (every `task.*` key, and `run.seed`, which
    the files task shuffles by), so that a refusal can name the setting that changed."""
    digest = hashlib.sha256()
    for p in problems:
        digest.update(json.dumps([p.prompt, p.answer], default=str).encode() + b"\n")
    settings = {f"task.{k}": v for k, v in dataclasses.asdict(cfg.task).items()}
    return {"num_items": len(problems), "sha256": digest.hexdigest(),
            "settings": {**settings, "run.seed": cfg.run.seed}}
