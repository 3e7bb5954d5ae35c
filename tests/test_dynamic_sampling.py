"""Dynamic sampling (`trainer.skip_zero_variance`): groups whose rewards are all equal are consumed,
not trained and not lost; every step still trains `batch_groups` groups, each with signal; the ledger
names each skipped group once with the reason `no_signal`, across a kill of the trainer and of the
producer, and no skipped group is ever issued again.

Run: `pytest tests/test_dynamic_sampling.py` (the real pipeline under supervisord, on CPU).
"""

import json

import numpy as np
import pytest
import torch

from harness.supervised_run import SupervisedRun

NUM_STEPS, BATCH_GROUPS = 12, 4
RUN = [f"--trainer.num_steps={NUM_STEPS}", f"--trainer.batch_groups={BATCH_GROUPS}", "--rollout.group_size=4",
       "--trainer.eval_every=0", "--task.num_test=10", "--trainer.checkpoint_every=3",
       "--trainer.skip_zero_variance=true", "--metrics.save_rollouts=true"]


@pytest.mark.slow
def test_groups_without_signal_are_consumed_once_and_never_trained(tmp_path):
    run = SupervisedRun(tmp_path / "run", RUN).start()
    try:
        run.wait_for_step(4)
        run.kill("rollout")  # restored from the trainer: it must learn the skipped groups from it
        run.wait_for_step(7)
        run.kill("trainer")  # back to step 6: skipped groups after it live on in the producer's ledger
        assert run.wait(timeout_s=600) == 0, run.tail()
    finally:
        run.stop()
    steps = run.steps()
    assert sorted(steps) == list(range(1, NUM_STEPS + 1))
    trained = [g for r in steps.values() for g in r["group_ids"]]
    assert len(trained) == len(set(trained)) == NUM_STEPS * BATCH_GROUPS
    # every trained group carried signal: its rewards were not all equal
    for line in (run.run_dir / "rollouts.jsonl").read_text().splitlines():
        rewards = [s["reward"] for s in json.loads(line)["samples"]]
        assert np.std(rewards) > 0, rewards
    ledger = json.loads((run.run_dir / "ledger.json").read_text())
    assert ledger["num_lost"] == 0 and ledger["num_trained_twice"] == 0, ledger
    skipped = {g for g, why in ledger["prompts"].items() if why == "dropped: no_signal"}
    assert len(skipped) >= 5, ledger  # at G=4 and ~25 % accuracy many groups are all wrong
    assert not skipped & set(trained)
    assert ledger["num_trained_once"] + len(skipped) + ledger["num_unfinished"] == ledger["num_prompts"], ledger
    final = torch.load(run.run_dir / "checkpoints" / f"step_{NUM_STEPS:06d}" / "trainer_state.pt", weights_only=True)
    assert set(final["no_signal_ids"]) <= skipped and len(final["no_signal_ids"]) >= 1
    assert steps[NUM_STEPS]["drops"].get("no_signal", 0) >= 1  # counted since the trainer's restart
