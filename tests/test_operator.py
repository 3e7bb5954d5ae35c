"""What an operator does to a run under the real supervisord: a typo in the config, a mistake only one
stage meets, a second `make run` while a run is live, supervisord itself killed and started again
with another train split (refused) and another batch size (taken).

Run: `pytest tests/test_operator.py` (slow: pipelines on the small policy).
"""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from harness.supervised_run import SupervisedRun
from nano_miles.run.process import processes_of_run

QUICK = ["--trainer.num_steps=16", "--trainer.batch_groups=8", "--rollout.group_size=4",
         "--trainer.eval_every=0", "--task.num_test=10", "--trainer.checkpoint_every=4"]


def spawns(run: SupervisedRun, program: str) -> int:
    return (run.run_dir / "supervisord.log").read_text().count(f"spawned: '{program}'")


@pytest.mark.slow
def test_a_typo_in_the_overrides_ends_the_run_in_seconds_with_its_line(tmp_path):
    """Before: every stage exited 2 and was restarted forever, the listener died on the same config
    and its event buffer overflowed, and no FAILED was written."""
    run = SupervisedRun(tmp_path / "run", QUICK + ["--trainer.nonexistent_key=1"]).start()
    started = time.monotonic()
    try:
        run.wait(timeout_s=60)
    finally:
        run.stop()
    assert time.monotonic() - started < 30, run.tail()
    failed = (run.run_dir / "FAILED").read_text()
    assert failed.startswith("failed: ") and "unknown key(s) in [trainer]: nonexistent_key" in failed, failed
    terminal = run.output.read_text()
    assert "unknown key(s) in [trainer]: nonexistent_key" in terminal and "Traceback" not in terminal, terminal
    for program in ("engine", "rollout", "reward", "trainer"):
        assert spawns(run, program) <= 1, (program, run.tail())


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where trainer.device=cuda is a mistake")
def test_a_mistake_only_the_trainer_meets_is_quoted_from_its_log(tmp_path):
    """The trainer's stderr goes to the terminal; its one line must also end trainer.log, which
    FAILED quotes (before: "see trainer.log", and no trainer.log existed)."""
    run = SupervisedRun(tmp_path / "run", QUICK + ["--trainer.device=cuda"]).start()
    try:
        run.wait(timeout_s=120)
    finally:
        run.stop()
    line = (run.run_dir / "trainer.log").read_text().splitlines()[-1]
    assert line.startswith("trainer: trainer.device is 'cuda'"), line
    assert (run.run_dir / "FAILED").read_text().strip() == f"failed: trainer stopped the run (exit 2); trainer.log: {line}"


def fresh(run_dir) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nano_miles.run.fresh", str(run_dir)], capture_output=True,
                          text=True, timeout=60)


@pytest.mark.slow
def test_a_second_make_run_and_a_killed_supervisord_lose_nothing(tmp_path):
    run = SupervisedRun(tmp_path / "run", QUICK).start()
    try:
        run.wait_for_step(5)
        # a second `make run` while this run is live: refused in one line, the run left as it is
        second = fresh(run.run_dir)
        assert second.returncode == 2 and second.stderr.count("\n") == 1 and "live run" in second.stderr, second
        assert (run.run_dir / "supervisor.sock").exists() and run.proc.poll() is None
        # supervisord itself killed: every process it started goes with it (before: the local
        # engine lived on, held its port, and the next start crash-looped on it)
        pids = processes_of_run(run.run_dir)
        assert len(pids) >= 4, pids
        run.proc.kill()
        run.proc.wait()
        deadline = time.monotonic() + 30
        while processes_of_run(run.run_dir):
            assert time.monotonic() < deadline, f"left running: {processes_of_run(run.run_dir)}"
            time.sleep(0.2)
        # started again with another train split: refused in one line, quoted in FAILED (before: the
        # ledger silently counted other prompts)
        run = SupervisedRun(run.run_dir, QUICK + ["--task.num_train=500"]).start()
        run.wait(timeout_s=120)
        failed = (run.run_dir / "FAILED").read_text()
        assert "task.num_train is 500" in failed and "was made with 0" in failed, failed
        # and with another batch size, which a run may change: it resumes and finishes
        run = SupervisedRun(run.run_dir, QUICK + ["--trainer.batch_groups=4"]).start()
        assert run.wait(timeout_s=400) == 0, run.tail()
    finally:
        run.stop()
    summary = run.summary()
    assert summary["ledger"]["num_lost"] == 0 and summary["ledger"]["num_trained_twice"] == 0, summary["ledger"]
    steps = run.steps()
    assert sorted(steps) == list(range(1, 17))
    ids = [g for r in steps.values() for g in r["group_ids"]]
    assert len(ids) == len(set(ids)) == summary["ledger"]["num_trained_once"]
    assert {len(r["group_ids"]) for r in steps.values()} == {8, 4}  # both batch sizes trained
    assert not (run.run_dir / "FAILED").exists()  # the finished attempt cleared the refused one's
    # the finished run is moved aside by the next `make run`
    assert fresh(run.run_dir).returncode == 0 and not (run.run_dir / "summary.json").exists()


def test_an_engine_port_held_by_an_earlier_start_of_the_run_is_named(tmp_path):
    """The check runs before the engine slot execs its server."""
    from harness.servers import free_port
    from nano_miles.engine.launch import refuse_a_held_port
    from nano_miles.run.cli import UserError

    port = free_port()
    holder = ("import socket, sys, time; s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[2]))); "
              "s.listen(); print('up', flush=True); time.sleep(60)")
    for env, expected in (({"NANOMILES_RUN_DIR": str(tmp_path)}, "held by pid {pid}, an engine an earlier start"),
                          ({}, "in use by another program")):
        proc = subprocess.Popen([sys.executable, "-c", holder, "--port", str(port)], stdout=subprocess.PIPE,
                                text=True, env={**os.environ, **env})
        try:
            assert proc.stdout.readline() == "up\n"
            with pytest.raises(UserError, match=expected.format(pid=proc.pid)):
                refuse_a_held_port("127.0.0.1", port, tmp_path)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    refuse_a_held_port("127.0.0.1", port, tmp_path)  # free again: nothing to say
