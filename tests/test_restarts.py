"""Stopping and restarting a run: a SIGTERM checkpoints the trainer's last step and is no "done", a
restart with another `trainer.batch_groups` goes on, one under another train split is refused.

Run: `pytest tests/test_restarts.py` (the last two are slow: whole pipelines under the real supervisord on
the small policy). That a trainer refuses a checkpoint of another split in one line is pinned in
`tests/test_trainer.py`.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import zmq

from harness.supervised_run import SupervisedRun
from nano_miles.run.cli import UserError
from nano_miles.run.config import load_config
from nano_miles.run.identity import refuse_another_split
from nano_miles.run.process import EXIT_STOPPED
from nano_miles.stages.rollout.producer import RolloutProducer
from nano_miles.tasks import Problem, load_problems, split_identity
from nano_miles.wire.codec import group_id_at
from nano_miles.wire.control import RestoreState

RUN = ["--rollout.group_size=4", "--trainer.eval_every=0", "--task.num_test=10",
       "--trainer.checkpoint_every=100"]  # checkpoints only at the end, or when stopped


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
    producer = RolloutProducer(cfg, ctx, [Problem("p", "0")] * 100, [[5, 6]] * 100, stop_token_ids=[])
    try:
        producer.control.run_id = "test-run"  # what the trainer's first `restore` sets
        trained = [group_id_at(position, 100) for position in range(40)]
        producer.on_restore(RestoreState(step=5, version=5, committed_group_ids=trained, cursor=40))
        producer.on_resume(5)
        batch = issue_while_allowed(producer)
        assert batch == [group_id_at(position, 100) for position in range(40, 44)]
        producer.on_commit(6, batch, {}, [])
        assert issue_while_allowed(producer) == []  # sync: step 7's batch waits for weights 6
        producer.on_resume(6)
        assert len(issue_while_allowed(producer)) == 4
    finally:
        producer.close()
        ctx.term()


def test_sigterm_ends_a_stage_with_a_status_that_is_not_done(tmp_path):
    """Exit 0 is "finished": the trainer's run is done, an unused engine slot has nothing to do; a stage
    told to stop has not finished (before: 0, and a plain `kill` of the trainer ended the run)."""
    code = ("import sys, time; from nano_miles.run.config import load_config; "
            "from nano_miles.run.process import setup_process; "
            f"setup_process('rollout', load_config(overrides=['--run.dir={tmp_path}'])); "
            "print('ready', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == EXIT_STOPPED != 0
    finally:
        proc.kill()
        proc.stdout.close()


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


def step_numbers(run: SupervisedRun) -> list[int]:
    """Every step record in metrics.jsonl, in the order written (a redone step would appear twice)."""
    return [r["step"] for r in run.metrics()]


@pytest.mark.slow
def test_a_plain_kill_of_the_trainer_resumes_where_it_stopped(tmp_path):
    """`kill <trainer pid>` at any moment: it checkpoints its last trained step, exits 143, supervisord
    starts it again, and it goes on from that step: nothing lost, nothing trained twice (before: it
    exited 0 and the run ended as done, without summary or ledger). A rollout restart afterwards
    rebuilds the version gate from the trainer's steps."""
    run = SupervisedRun(tmp_path / "run", RUN + ["--trainer.num_steps=10", "--trainer.batch_groups=4"]).start()
    try:
        run.wait_for_step(3)
        pid = run.stage_pid("trainer")
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 120
        while run.stage_pid("trainer") == pid:
            assert time.monotonic() < deadline, run.tail()
            time.sleep(0.2)
        stopped_at = max(step_numbers(run))
        run.wait_for_step(stopped_at + 1)
        run.kill("rollout")  # restored while the trainer pulls: the gate counts the steps it has
        assert run.wait(timeout_s=600) == 0, run.tail()
    finally:
        run.stop()
    log = (run.run_dir / "supervisord.log").read_text()
    assert "exited: trainer (exit status 143; not expected)" in log, log
    assert f"from step {stopped_at} of 10 " in (run.run_dir / "trainer.log").read_text()
    assert step_numbers(run) == list(range(1, 11)), "a step was lost or trained again"
    ledger = run.summary()["ledger"]
    assert ledger["num_lost"] == 0 and ledger["num_trained_twice"] == 0 and ledger["num_trained_once"] == 40
    assert not (run.run_dir / "FAILED").exists()


@pytest.mark.slow
def test_a_shutdown_checkpoints_and_the_run_goes_on_with_another_batch_size(tmp_path):
    """supervisord stopped (Ctrl-C, `supervisorctl shutdown`) mid-run: the trainer's last step is
    checkpointed and nothing else ends the run (before: it resumed from its last periodic checkpoint).
    Started again on the same directory with half the batch, the run goes on from that step and ends
    (before: the version gate never opened, and nothing ended)."""
    run_dir = tmp_path / "run"
    first = SupervisedRun(run_dir, RUN + ["--trainer.num_steps=8", "--trainer.batch_groups=4"]).start()
    try:
        first.wait_for_step(3)
        first.proc.send_signal(signal.SIGTERM)  # what Ctrl-C and `supervisorctl shutdown` do
        first.wait(timeout_s=120)
    finally:
        first.stop()
    stopped_at = max(step_numbers(first))
    assert (run_dir / "checkpoints" / f"step_{stopped_at:06d}" / "model.safetensors").exists(), first.tail()
    assert not (run_dir / "summary.json").exists() and not (run_dir / "FAILED").exists()
    assert "stopped: trainer (exit status 143)" in (run_dir / "supervisord.log").read_text()
    assert "Traceback" not in first.output.read_text()  # what the terminal showed

    again = SupervisedRun(run_dir, RUN + ["--trainer.num_steps=8", "--trainer.batch_groups=2"]).start()
    try:
        assert again.wait(timeout_s=300) == 0, again.tail()
    finally:
        again.stop()
    assert f"from step {stopped_at} of 8 " in (run_dir / "trainer.log").read_text()
    assert step_numbers(again) == list(range(1, 9)), "a step was lost or trained again"
    assert [len(again.steps()[k]["group_ids"]) for k in range(1, 9)] == [4] * stopped_at + [2] * (8 - stopped_at)
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert ledger["num_lost"] == 0 and ledger["num_trained_twice"] == 0
    assert ledger["num_trained_once"] == 4 * stopped_at + 2 * (8 - stopped_at)
