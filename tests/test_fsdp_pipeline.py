"""A 2-rank trainer (trainer.strategy = fsdp2, gloo on the CPU) inside the real supervisord pipeline."""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from conftest import FINAL_PARITY, REPO
from harness.supervised_run import SupervisedRun
from nano_miles.run.process import processes_of_run
from test_chaos import CHAOS, kill_every_stage_twice

TWO_RANKS = ["--trainer.strategy=fsdp2", "--trainer.world_size=2"]


def rank_pid(run: SupervisedRun, rank: int, timeout_s: float = 60) -> int:
    """The pid of the trainer's rank `rank` (a child of the launcher supervisord started)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        launcher = run.stage_pid("trainer")
        for pid in processes_of_run(run.run_dir):
            try:
                parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except (OSError, IndexError, ValueError):
                continue
            if parent == launcher and f"RANK={rank}".encode() in environ:
                return pid
        time.sleep(0.2)
    raise AssertionError(f"no rank {rank} under the trainer:\n{run.tail()}")


@pytest.mark.slow
def test_a_two_rank_run_learns_and_a_one_process_trainer_continues_it(tmp_path):
    """The sync learning config: 24 steps on 2 ranks, the last 24 in one plain process from the
    2-rank checkpoint; the run learns as the one-process config does."""
    from harness.learning_runs import SYNC, margin
    first = SupervisedRun(tmp_path / "run", [*SYNC, *TWO_RANKS, "--trainer.num_steps=24"]).start()
    try:
        assert first.wait(timeout_s=600) == 0, first.tail()
    finally:
        first.stop()
    checkpoint = first.run_dir / "checkpoints" / "step_000024"
    assert (checkpoint / "model.safetensors").is_file() and len(list((checkpoint / "optimizer").iterdir())) >= 2
    exported = subprocess.run([sys.executable, "-m", "nano_miles.export", str(checkpoint), str(tmp_path / "out")],
                              cwd=REPO, capture_output=True, text=True)
    assert exported.returncode == 0, exported.stderr
    assert not (tmp_path / "out" / "optimizer").exists()
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32)
    saved = load_file(str(checkpoint / "model.safetensors"))
    assert all(torch.equal(p, saved[n]) for n, p in model.named_parameters() if n in saved)
    (first.run_dir / "summary.json").unlink()  # finished at 24: the same run goes on to 48
    run = SupervisedRun(tmp_path / "run", SYNC).start()
    try:
        assert run.wait(timeout_s=600) == 0, run.tail()
    finally:
        run.stop()
    records, s = run.metrics(), run.summary()
    assert [r["step"] for r in records] == list(range(1, 49))
    assert all(r["version"] == r["step"] for r in records) and s["final_parity"] <= FINAL_PARITY
    assert "resuming run" in (run.run_dir / "trainer.log").read_text()
    # the one-process sync config's margin: half the smallest gain of five seeds
    assert s["eval_accuracy_max"] - s["eval_accuracy_start"] >= margin("sync", "eval_gain"), s
    assert s["reward_late"] - s["reward_early"] >= margin("sync", "reward_gain"), s
    assert s["ledger"]["num_lost"] == 0 and s["ledger"]["num_trained_twice"] == 0


@pytest.mark.slow
def test_kill_9_of_each_rank_the_launcher_and_two_engines_on_a_weight_group_loses_nothing(tmp_path):
    """The layout of several GPUs, gloo in NCCL's place: a 2-rank trainer, two engines behind the
    router, the weights broadcast over the weight group. Rank 1 and rank 0 are killed on their own
    (the launcher exits 1, supervisord starts it again), then the launcher (its ranks die with it) and
    each engine twice; the trainer builds the group again after each restart."""
    pytest.importorskip("sglang_router")
    rng = random.Random(7)

    def kill_each_rank(run: SupervisedRun) -> None:
        run.wait_for_step(1)  # the weight group is up
        for rank in (1, 0):
            time.sleep(rng.uniform(0.5, 2.0))
            launcher, last_step = run.stage_pid("trainer"), max(run.steps(), default=0)
            os.kill(rank_pid(run, rank), signal.SIGKILL)
            deadline = time.monotonic() + 120
            while run.stage_pid("trainer") == launcher or max(run.steps(), default=0) <= last_step:
                assert time.monotonic() < deadline, f"no step after killing rank {rank}:\n{run.tail()}"
                time.sleep(0.1)

    layout = ["--engine.replicas=2", "--engine.weight_transport=distributed", "--engine.weight_group_timeout_s=20"]
    summary = kill_every_stage_twice(tmp_path / "run", [*CHAOS, *TWO_RANKS, *layout, "--trainer.num_steps=30"],
                                     num_steps=30, batch_groups=8, first=kill_each_rank,
                                     stages=("trainer", "engine", "engine_1"))
    assert summary["weight_transport"] == "distributed"
    log = (tmp_path / "run" / "supervisord.log").read_text()
    assert log.count("exited: trainer (exit status 1; not expected)") == 2, log
    # every rank left by itself once rank 0 was gone: none had to wait for the agent's SIGKILL
    assert "forcefully exiting" not in (tmp_path / "run" / "supervisord.out").read_text()
    # each of the 5 trainer starts builds a group before its first step, and an engine's restart
    # that the trainer outlives builds another
    trainer_log = (tmp_path / "run" / "trainer.log").read_text()
    assert trainer_log.count("weight group weight_update_group ready") >= 6, trainer_log[-3000:]
