"""Restarting a run: one with another `trainer.batch_groups` goes on (the version gate counts the trainer's
steps), one under another train split is refused.

Run: `pytest tests/test_restarts.py`. That a trainer refuses such a checkpoint in one line is pinned in
`tests/test_trainer.py`.
"""

import json
from types import SimpleNamespace

import pytest
import zmq

from nano_miles.run.cli import UserError
from nano_miles.run.config import load_config
from nano_miles.run.identity import refuse_another_split
from nano_miles.stages.rollout.producer import RolloutProducer
from nano_miles.tasks import load_problems, split_identity
from nano_miles.wire.codec import group_id_at
from nano_miles.wire.control import RestoreState


def issue_while_allowed(producer: RolloutProducer) -> list[str]:
    """The ids the version gate lets start now (taken from the ledger; nothing is generated)."""
    issued = []
    while producer.may_issue():
        issued.append(producer.ledger.next_group()[0])
    return issued


def test_a_restart_with_another_batch_size_opens_the_version_gate(tmp_path):
    """5 steps of 8 groups, then the run restarted with 4 a step: the producer issues the next batch
    (before: the 40 groups trained counted against (version + 1) * 4 = 24, and nothing ever started)."""
    cfg = load_config(overrides=[f"--reward.endpoint=ipc://{tmp_path}/reward.sock",
                                 f"--rollout.control_endpoint=ipc://{tmp_path}/control.sock",
                                 "--rollout.metrics_port=0", "--trainer.batch_groups=4", "--task.num_train=100"])
    ctx = zmq.Context()
    producer = RolloutProducer(cfg, ctx, [SimpleNamespace(answer="0")] * 100, [[5, 6]] * 100, stop_token_ids=[])
    try:
        producer.control.run_id = "test-run"  # what the trainer's first `restore` sets
        trained = [group_id_at(position, 100) for position in range(40)]
        producer.on_restore(RestoreState(step=5, version=5, committed_group_ids=trained, cursor=40))
        producer.on_resume(5)
        batch = issue_while_allowed(producer)
        assert batch == [group_id_at(position, 100) for position in range(40, 44)]
        producer.on_commit(6, batch, [], [])
        assert issue_while_allowed(producer) == []  # sync: step 7's batch waits for weights 6
        producer.on_resume(6)
        assert len(issue_while_allowed(producer)) == 4
    finally:
        producer.close()
        ctx.term()


def test_a_data_file_edited_under_the_same_settings_is_another_split(tmp_path):
    """The split is its problems, not only the settings that chose them: an edited file is refused too."""
    train = tmp_path / "train.jsonl"
    cfg = load_config(overrides=["--task.name=nano_miles.tasks.files", f"--task.train_file={train}",
                                 "--task.num_test=1", "--task.prompt_key=q", "--task.label_key=a"])
    train.write_text("".join(json.dumps({"q": f"{i} + 1 =", "a": str(i + 1)}) + "\n" for i in range(5)))
    before = split_identity(cfg, load_problems(cfg, "train"))
    refuse_another_split(before, split_identity(cfg, load_problems(cfg, "train")), tmp_path / "step_000003")
    train.write_text(train.read_text().replace('"a": "3"', '"a": "4"'))
    with pytest.raises(UserError, match="problems changed under the same settings .*step_000003"):
        refuse_another_split(before, split_identity(cfg, load_problems(cfg, "train")), tmp_path / "step_000003")
