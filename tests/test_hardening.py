"""Faults the chaos test does not make, under the real supervisord with the default 60 s lease: a trainer
restart must not wait out leases, stray and foreign messages must not touch durable state, a hung
stage is restarted, a stage that cannot start ends the run with FAILED.

Run: `pytest tests/test_hardening.py` (slow: whole pipelines on the small policy).
"""

import json
import os
import shutil
import signal
import statistics
import time

import numpy as np
import pytest
import zmq

from harness.supervised_run import SupervisedRun
from nano_miles.engine.client import EngineClient
from nano_miles.run.config import DEFAULT_POLICY_DIR, load_config
from nano_miles.run.identity import read_run_identity
from nano_miles.wire.data import RolloutGroup, Sample, ScoredGroup, encode_scored
from nano_miles.wire.sockets import make_socket

NUM_STEPS = 24
HARD = [f"--trainer.num_steps={NUM_STEPS}", "--trainer.batch_groups=8", "--rollout.group_size=4",
        "--trainer.eval_every=0", "--task.num_test=10", "--trainer.checkpoint_every=4", "--run.hang_timeout_s=8",
        "--trainer.control_timeout_s=2", "--trainer.control_retries=3"]  # a hang timeout above 2 x 3 s
LEASE_S = load_config().rollout.lease_s


def scored_group(run_id: str, group_id: str) -> bytes:
    """A well-formed scored group generated under weights version 0."""
    samples = [Sample(np.array([5, 6], np.int32), np.array([-1.0, -1.0], np.float32), np.zeros(2, np.int32),
                      "stop") for _ in range(4)]
    group = RolloutGroup(group_id, 0, np.array([3, 4], np.int32), samples, {"label": "0"}, run_id=run_id)
    return encode_scored(ScoredGroup(group, np.array([1, 0, 1, 0], np.float32)))


def events(run: SupervisedRun) -> list[dict]:
    path = run.run_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
def test_trainer_restart_stray_messages_and_a_hung_stage(tmp_path):
    assert LEASE_S == 60.0  # the default a user runs with: recovery must not depend on it
    run = SupervisedRun(tmp_path / "run", HARD).start()
    cfg = load_config(overrides=run.overrides)
    ctx = zmq.Context()
    try:
        run.wait_for_step(6)
        step_s = statistics.median(r["step_s"] for r in run.steps().values())
        # 1. the trainer dies: what it held comes back at once, not when the leases run out
        kill = run.kill("trainer")
        first = run.steps()[5]  # the newest checkpoint is step 4: step 5 is the first after the restart
        assert first["wait_s"] < LEASE_S / 4, (first["wait_s"], step_s, run.tail())
        # 2. a stale group with a made-up id of this run, and a group of another run
        push = make_socket(ctx, zmq.PUSH, cfg.trainer.endpoint, bind=False)
        run_id, _ = read_run_identity(run.run_dir)
        push.send(scored_group(run_id, "e0-i5000"))
        push.send(scored_group("another-run", "e0-i7"))
        # 3. the reward stage, the producer and the engine hang in turn: each is restarted after
        # run.hang_timeout_s, and nothing else (before: a stopped engine was never restarted, and
        # the trainer waiting for it or for a stopped producer was killed and rolled back instead)
        for stage in ("reward", "rollout", "engine"):
            run.wait_for_step(max(run.steps()) + 1)
            pid = run.stage_pid(stage)
            os.kill(pid, signal.SIGSTOP)
            deadline = time.monotonic() + 90
            while not any(e["stage"] == stage for e in events(run)):
                assert time.monotonic() < deadline and run.proc.poll() is None, run.tail()
                time.sleep(0.5)
            assert run.stage_pid(stage) != pid
        assert run.wait(timeout_s=600) == 0, run.tail()
    finally:
        ctx.destroy(linger=0)
        run.stop()
    (tmp_path / "recovery.json").write_text(json.dumps({"kill": kill, "step_s": step_s}, default=str))
    summary = run.summary()
    ledger = summary["ledger"]
    assert ledger["num_lost"] == 0 and ledger["num_trained_twice"] == 0, ledger
    assert ledger["num_trained_once"] == NUM_STEPS * 8, "a stray id moved the data cursor"
    drops = run.steps()[NUM_STEPS]["drops"]
    assert drops.get("foreign_run") == 1 and drops.get("stale", 0) >= 1, drops
    steps = run.steps()
    ids = [g for r in steps.values() for g in r["group_ids"]]
    assert len(ids) == len(set(ids)) == NUM_STEPS * 8 and "e0-i5000" not in ids
    assert 0 < summary["goodput"] <= 1
    hang = [e for e in events(run) if e["event"] == "hang_restart"]
    # restarted only once silent for more than run.hang_timeout_s = 8; the event keeps it to 0.1 s (8.04 -> 8.0)
    assert [e["stage"] for e in hang] == ["reward", "rollout", "engine"] and all(e["silent_s"] >= 8 for e in hang), hang
    watch_log = (run.run_dir / "run_end.log").read_text()
    assert "restarting it" in watch_log and "Traceback" not in watch_log, watch_log


@pytest.mark.slow
def test_a_stage_that_cannot_start_ends_the_run_with_failed(tmp_path):
    broken = tmp_path / "broken_model"
    shutil.copytree(DEFAULT_POLICY_DIR, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # loads its config, fails on the weights
    run = SupervisedRun(tmp_path / "run", HARD + [f"--model.path={broken}"]).start()
    try:
        run.wait(timeout_s=240)  # before: restarted forever, no FAILED, the run never ends
    finally:
        run.stop()
    failed = (run.run_dir / "FAILED").read_text()
    assert failed.startswith("failed: ") and any(stage in failed for stage in ("engine", "rollout", "reward",
                                                                               "trainer")), failed


@pytest.mark.slow
def test_an_engine_restarted_while_the_producer_is_down_is_given_weights(tmp_path):
    """The engine restarts (serving its base weights) while the trainer waits for a stopped producer (in its
    look at its peers while it pulls a batch, or in a commit or resume, wherever the stop finds it); then the
    producer restarts too. The trainer restores the producer at its own weight version, and the producer
    generates at once. Before, the trainer looked at the engine's version before it waited for the producer,
    and after that only in a second without groups, which the stream of stale groups from the base weights
    never left it: it refused them for ever and never pushed its weights again."""
    run = SupervisedRun(tmp_path / "run", HARD + ["--run.hang_timeout_s=60"]).start()  # the test stops them
    cfg = load_config(overrides=run.overrides)

    def times_trainer_waited() -> int:
        return (run.run_dir / "trainer.log").read_text().count("waiting for the rollout producer")

    try:
        run.wait_for_step(4)
        reward = run.stage_pid("reward")
        os.kill(reward, signal.SIGSTOP)  # no batch completes: the trainer stays in its pull
        producer = run.stage_pid("rollout")
        waited = times_trainer_waited()
        os.kill(producer, signal.SIGSTOP)
        deadline = time.monotonic() + 60
        while times_trainer_waited() == waited:  # its next control request waits for the producer
            assert time.monotonic() < deadline, run.tail()
            time.sleep(0.2)
        engine = run.stage_pid("engine")
        os.kill(engine, signal.SIGKILL)
        client = EngineClient(cfg.engine.url)
        while run.stage_pid("engine") == engine:
            time.sleep(0.2)
        client.wait_until_healthy(60)
        assert client.weight_version() == 0  # the restarted engine serves the base weights
        os.kill(producer, signal.SIGKILL)
        os.kill(reward, signal.SIGCONT)
        assert run.wait(timeout_s=240) == 0, run.tail()
    finally:
        run.stop()
    summary = run.summary()
    ledger = summary["ledger"]
    assert ledger["num_lost"] == 0 and ledger["num_trained_twice"] == 0, ledger
    assert ledger["num_trained_once"] == NUM_STEPS * 8
    assert summary["staleness_max"] == 0  # sync: nothing was trained on the engine's base weights
    assert (run.run_dir / "trainer.log").read_text().count("restoring the producer") == 2  # its start, and here
