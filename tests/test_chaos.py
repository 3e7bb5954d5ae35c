"""Crash-only: SIGKILL any stage at any time under the real supervisord; nothing is lost or trained twice."""

import json
import random
import time

import pytest

from conftest import FINAL_PARITY
from harness.supervised_run import SupervisedRun

STAGES = ("engine", "rollout", "reward", "trainer")
CHAOS = ["--trainer.num_steps=80", "--trainer.batch_groups=8", "--rollout.group_size=4",
         "--trainer.eval_every=0", "--task.num_test=10", "--trainer.checkpoint_every=3",
         "--trainer.control_timeout_s=2", "--trainer.control_retries=2"]


def kill_every_stage_twice(run_dir, overrides: list[str], *, num_steps: int, batch_groups: int,
                           config: str | None = None, first=None, stages=STAGES) -> dict:
    """Run `overrides` (on `config`) under the real supervisord, SIGKILL every stage (of `stages`) twice
    in a random order at random times, and check that every group was trained exactly once and the
    engine serves the final weights. `first(run)`: other kills, before those. The run's summary."""
    rng = random.Random(1234)
    victims = list(stages) * 2
    rng.shuffle(victims)
    run = SupervisedRun(run_dir, overrides, config=config).start()
    restarts = []
    try:
        run.stage_pid("trainer")
        if first is not None:
            first(run)
        for stage in victims:
            time.sleep(rng.uniform(0.5, 2.5))
            if run.proc.poll() is not None:
                break
            restarts.append(run.kill(stage))
        assert len(restarts) == len(victims), f"run ended before all kills: {restarts}"
        assert run.wait(timeout_s=900) == 0, run.tail()
    finally:
        run.stop()
    (run_dir / "kills.json").write_text(json.dumps(restarts))
    summary = run.summary()
    ledger = json.loads((run.run_dir / "ledger.json").read_text())
    assert ledger["num_lost"] == 0 and ledger["num_trained_twice"] == 0, ledger
    assert ledger["num_trained_once"] == num_steps * batch_groups
    steps = run.steps()
    assert sorted(steps) == list(range(1, num_steps + 1))
    ids = [g for r in steps.values() for g in r["group_ids"]]
    assert len(ids) == len(set(ids)) == num_steps * batch_groups, "a group was trained twice in the final model"
    assert summary["engine_final_version"] == str(num_steps), "engine does not serve the final weights"
    assert summary["final_parity"] <= FINAL_PARITY, "engine weights differ from the trainer's"
    log = (run.run_dir / "supervisord.log").read_text()
    for stage in stages:
        assert log.count(f"exited: {stage} (terminated by SIGKILL") >= 2, stage
    return summary


@pytest.mark.slow
def test_kill_every_stage_twice_and_lose_nothing(tmp_path):
    kill_every_stage_twice(tmp_path / "run", CHAOS, num_steps=80, batch_groups=8)


@pytest.mark.slow
def test_trainer_killed_between_weight_push_and_checkpoint(tmp_path):
    run = SupervisedRun(tmp_path / "run", CHAOS[:5] + ["--trainer.num_steps=12",
                                                      "--trainer.checkpoint_every=4"]).start()
    try:
        deadline = time.monotonic() + 300
        while max(run.steps(), default=0) < 6:  # weights v6 pushed; newest checkpoint is 4
            assert time.monotonic() < deadline and run.proc.poll() is None, run.tail()
            time.sleep(0.05)
        before = run.steps()
        run.kill("trainer")
        assert run.wait(timeout_s=600) == 0, run.tail()
    finally:
        run.stop()
    trainer_log = (run.run_dir / "trainer.log").read_text()
    assert "from step 4 of 12" in trainer_log and "checkpoints/step_000004" in trainer_log
    after = run.steps()
    assert sorted(after) == list(range(1, 13))
    for step in range(1, 5):  # checkpointed history is kept as it was
        assert after[step]["group_ids"] == before[step]["group_ids"]
    ids = [g for r in after.values() for g in r["group_ids"]]
    assert len(ids) == len(set(ids)), "a group of the rolled-back steps was counted twice"
    assert [after[k]["version"] for k in sorted(after)] == list(range(1, 13))
    s = run.summary()
    assert s["engine_final_version"] == "12" and s["final_parity"] <= FINAL_PARITY
    assert s["ledger"]["num_lost"] == 0 and s["ledger"]["num_trained_twice"] == 0
