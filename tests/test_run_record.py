"""The trainer's run record: metrics.jsonl, the end-of-run files, and the TensorBoard and W&B sinks for real.

The sinks run with their real packages (W&B in offline mode: it writes its run under the run directory
and talks to no server), from the first step to `finish`, which is where a sink that cannot close breaks.
"""

import json

import pytest

from nano_miles.algo.diagnostics import LearnResult, LossDiagnostics, StepStats
from nano_miles.observe.run_record import RunRecord, StepRecord, read_jsonl
from nano_miles.run.config import load_config


def stats(reward: float) -> StepStats:
    learned = LearnResult(pg_loss=-0.01, means=LossDiagnostics(clip_fraction=0.0, dual_clip_fraction=0.0, parity=1e-7,
                                                               entropy=0.4),
                          grad_norm=0.5, num_tokens=64, lr=1e-4, peak_memory_mb=300.0, train_tokens_per_s=5000.0)
    return StepStats(reward=reward, format=1.0, accuracy=reward, learned=learned, staleness_hist={"0": 8},
                     num_samples=8, update_ms=3.0)


def record(step: int, reward: float, **extra) -> StepRecord:
    return StepRecord(step=step, version=step, stats=stats(reward), wait_s=0.5, update_split_ms={"apply": 2.0},
                      queue_depth=1, goodput=0.9, num_generated_tokens=100 * step, num_resumed_samples=0,
                      group_ids=[f"e0-i{step}"], drops={},
                      step_s=1.0, phase_s={"train": 0.4}, **extra)


@pytest.fixture
def run_cfg(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")   # no server: the run is written under the run directory
    monkeypatch.setenv("WANDB_SILENT", "true")
    return load_config(overrides=[f"--run.dir={tmp_path}", "--metrics.tensorboard=true",
                                  "--metrics.wandb_project=nano-miles-test", "--metrics.queue_sample_s=0",
                                  "--metrics.plots=false"])


def test_steps_and_sinks_from_first_step_to_finish(run_cfg, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = RunRecord(run_cfg, decode=str)
    assert [type(s).__name__ for s in run.sinks] == ["TensorBoardSink", "WandbSink"]
    run.write_step(record(1, 0.25))
    run.write_step(record(2, 0.5, evaluation={"step": 2, "elapsed_s": 1.0, "accuracy": 0.3, "reward": 0.4,
                                                 "pass_at_k": None, "k": 1, "parts": {"first_step": 0.1}}))
    run.write_step(record(2, 0.75))  # step 2 again, after a restart: this one wins
    wandb_run = run.sinks[1].run
    assert wandb_run.summary["reward"] == 0.25  # W&B got step 1 (step 2 is flushed at finish)
    steps = run.steps(last_step=2)
    assert [(r["step"], r["reward"]) for r in steps] == [(1, 0.25), (2, 0.75)]
    assert "eval_accuracy" not in steps[1] and read_jsonl(tmp_path / "metrics.jsonl")[1]["eval_accuracy"] == 0.3
    assert read_jsonl(tmp_path / "metrics.jsonl")[1]["eval_first_step"] == 0.1
    run.finish(steps, {"num_steps": 2}, {"num_lost": 0})

    assert json.loads((tmp_path / "summary.json").read_text()) == {"num_steps": 2}
    assert json.loads((tmp_path / "ledger.json").read_text()) == {"num_lost": 0}
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    rewards = [(e.step, e.value) for e in events.Scalars("reward")]
    assert rewards == [(1, 0.25), (2, 0.5), (2, 0.75)]
    assert [e.value for e in events.Scalars("phase_s/train")] == pytest.approx([0.4] * 3)
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb")), "W&B wrote no offline run"


def test_the_run_writes_its_plots_and_the_report_says_where(tmp_path):
    """What `make run` promises a newcomer: both PNGs, and the end-of-run report naming them."""
    from nano_miles.observe.plots import write_plots
    from nano_miles.observe.report import report

    steps = [{"step": 1, "reward": 0.2, "accuracy": 0.1}, {"step": 2, "reward": 0.4, "accuracy": 0.3}]
    queues = [{"time": 10.0 + t, "depth_groups": {"rollout_to_reward": t}} for t in range(3)]
    written = write_plots(tmp_path, steps, queues)
    assert sorted(p.name for p in written) == ["queue_depth.png", "reward_accuracy.png"]
    summary = {"num_steps": 2, "reward_early": 0.2, "reward_late": 0.4, "reward_delta": 0.2,
               "eval_accuracy_start": 0.1, "eval_accuracy_max": 0.3, "eval_accuracy_end": 0.3,
               "eval_accuracy_delta": 0.2, "mean_step_s": 1.0, "mean_update_ms": 3.0, "staleness_max": 0}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    text, is_ok = report(tmp_path)
    assert is_ok and f"{tmp_path / 'queue_depth.png'}, {tmp_path / 'reward_accuracy.png'}" in text


def test_a_line_still_being_written_is_left_for_the_next_read(tmp_path):
    """A live run's reader (the tests' harness, `top`) may read while the trainer appends a line."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "rew')
    assert read_jsonl(path) == [{"step": 1}]
    path.write_text('{"step": 1}\n{"step": 2, "reward": 0.5}\n')
    assert read_jsonl(path) == [{"step": 1}, {"step": 2, "reward": 0.5}]
