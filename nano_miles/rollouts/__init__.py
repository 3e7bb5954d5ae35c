"""Rollout functions: what one group's rollout is, plugged in by dotted path (`rollout.fn`).
Used as a library by the rollout producer and the trainer's held-out evaluation: `load_rollout(cfg.rollout)`.

A rollout function takes `(record, engine)` and returns one trajectory per sample of the group
(`rollout.group_size` of them):

    def rollout(record: Record, engine: RolloutEngine) -> list[Trajectory]

`record` is the problem (`Record`: its index, its prompt as the task gives it and as the ids the
engine reads, its label); `engine` (`engine.py`) generates from token ids and returns token ids,
log-probs, per-token weight versions and a finish reason, resuming whatever a weight update cut, so
a rollout function never sees a pause; `RolloutEngine.next_turn(role, text)` renders a tool's or a user's
turn through the chat template, once. A `Trajectory` (`trajectory.py`) holds the model's turns and the
environment's tokens between them; only the model's are trained.

The producer keeps everything else: which group runs when (the version gate), the ledger, retries of
a failed engine, the control channel. A function is called in one of the producer's threads, once
per group attempt, and may call `RolloutEngine.generate` as often as it likes. Built in:
`nano_miles.rollouts.single_turn:rollout` (the default: one answer per sample) and
`nano_miles.rollouts.tools:rollout` (a model that calls a calculator between its turns).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from nano_miles.rollouts.engine import Generation, RolloutEngine
from nano_miles.rollouts.trajectory import Trajectory
from nano_miles.run.cli import UserError
from nano_miles.run.plugins import load_function

__all__ = ["Generation", "Record", "RolloutEngine", "Trajectory", "load_rollout", "make_records", "sample_group"]


@dataclass(frozen=True)
class Record:
    """One problem as a rollout function gets it."""

    index: int                # its position in the split (the group id names it)
    prompt: str | tuple       # as the task gives it: text, or chat messages
    prompt_ids: list[int]     # the prompt rendered (chat template) and tokenized once: what the engine reads first
    label: str                # what the reward function compares with


def make_records(problems, prompt_ids: list[list[int]]) -> list[Record]:
    return [Record(i, p.prompt, ids, p.answer) for i, (p, ids) in enumerate(zip(problems, prompt_ids))]


def load_rollout(rollout_cfg) -> Callable:
    """The function `rollout.fn` names; a UserError naming it if it does not import."""
    return load_function(rollout_cfg.fn, "rollout.fn")


def sample_group(fn: Callable, record: Record, engine: RolloutEngine) -> list:
    """The group's samples (`wire.data.Sample`) from the rollout function; what it returns is checked
    here, so that a function that breaks the contract is named in one line."""
    trajectories = fn(record, engine)
    if not isinstance(trajectories, list) or len(trajectories) != engine.group_size:
        got = f"{len(trajectories)} items" if isinstance(trajectories, list) else type(trajectories).__name__
        raise UserError(f"rollout.fn must return a list of {engine.group_size} trajectories (rollout.group_size); "
                        f"it returned {got}")
    for i, t in enumerate(trajectories):
        if not isinstance(t, Trajectory) or not any(t.is_model):
            raise UserError(f"rollout.fn returned {type(t).__name__} at {i}: each item must be a Trajectory "
                            "holding at least one of the model's turns")
        if len(t) > engine.max_new_tokens:
            raise UserError(f"rollout.fn returned a trajectory of {len(t)} tokens at {i}, more than "
                            f"rollout.max_new_tokens = {engine.max_new_tokens}")
    return [t.to_sample() for t in trajectories]
