"""The default rollout (`rollout.fn = "nano_miles.rollouts.single_turn:rollout"`): one answer per sample.
Used as a library by the producer and the evaluation through `rollout.fn`.

Every sample of the group reads the prompt and writes one turn, up to `rollout.max_new_tokens`; the
group goes to the engine as one request, which batches it.
"""

from __future__ import annotations

from nano_miles.rollouts.engine import RolloutEngine
from nano_miles.rollouts.trajectory import Trajectory


def rollout(record, engine: RolloutEngine) -> list[Trajectory]:
    return [Trajectory.of(g) for g in engine.generate([record.prompt_ids] * engine.group_size)]
