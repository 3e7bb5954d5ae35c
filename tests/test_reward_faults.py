"""A reward function that raises, hangs or returns NaN costs one sample, never the reward stage; one that
fails on a whole group, or on more than reward.max_failure_fraction of the samples, is broken and
ends the stage (and the trainer's evaluation) in one line naming it and its error.

Run: `pytest tests/test_reward_faults.py`. A real RewardStage on ipc:// sockets, fed real rollout
messages, the real procs/reward.py, the trainer's evaluator on a real local engine; the misbehaving
reward functions are defined here.
"""

import os
import subprocess
import time
from contextlib import contextmanager

import numpy as np
import pytest
import zmq

from harness.servers import REPO_ROOT, proc_command
from nano_miles.engine.client import EngineClient
from nano_miles.run.cli import UserError
from nano_miles.run.config import load_config
from nano_miles.stages.reward.scorer import RewardStage
from nano_miles.stages.trainer.evaluate import make_evaluator
from nano_miles.rewards.worker import RewardFailure, RewardWorker
from nano_miles.tasks import Problem
from nano_miles.tasks.prompts import load_tokenizer
from nano_miles.wire.codec import make_group_id
from nano_miles.wire.data import RolloutGroup, Sample, decode_scored, encode_rollout

# response token -> what the reward function does with it
BEHAVIOUR = {1: "ok", 2: "raise", 3: "hang", 4: "nan", 5: "exit"}


def unruly_reward(response: str, label: str) -> dict[str, float]:
    if response == "raise":
        raise KeyError("no such answer")
    if response == "hang":
        time.sleep(3600)
    if response == "nan":
        return {"reward": float("nan"), "format": 1.0}
    if response == "exit":
        os._exit(3)
    return {"reward": 1.0, "format": 1.0}


def group_of(index: int, tokens: list[int]) -> RolloutGroup:
    samples = [Sample(np.array([t], np.int32), np.array([-0.5], np.float32), np.array([0], np.int32), "stop")
               for t in tokens]
    return RolloutGroup(make_group_id(0, index), 0, np.array([7, 8], np.int32), samples, {"label": "x"},
                        run_id="run-a")


def test_worker_fast_path_and_failures():
    worker = RewardWorker(unruly_reward, timeout_s=0.5)
    worker.start()
    try:
        assert worker("ok", "x") == {"reward": 1.0, "format": 1.0}
        reasons = []
        for response in ("raise", "hang", "nan", "exit", "ok"):
            try:
                worker(response, "x")
            except RewardFailure as failure:
                reasons.append(failure.reason)
        assert reasons == ["reward_error", "reward_timeout", "reward_nonfinite", "reward_error"]
        assert worker.num_restarts == 2  # after the hang and after the exit
        started = time.perf_counter()
        for _ in range(200):
            worker("ok", "x")
        assert (time.perf_counter() - started) / 200 < 0.005  # the fast path reuses the worker
    finally:
        worker.stop()


def returns_text(response: str, label: str):
    return "1.0"


def takes_one_argument(response: str) -> dict[str, float]:
    return {"reward": 1.0}


def raises_on_every_label(response: str, label: str) -> dict[str, float]:
    raise ValueError(f"cannot parse the label {label!r}")


# the ways a reward function is broken rather than unlucky, and the error each one's line names
BROKEN = {returns_text: "TypeError: a reward function returns a float or a dict of floats, not str",
          takes_one_argument: "TypeError: takes_one_argument() takes 1 positional argument but 2 were given",
          raises_on_every_label: "ValueError: cannot parse the label 'x'"}


@contextmanager
def stage_between(tmp_path, reward_fn, *overrides: str):
    """A real RewardStage scoring with `reward_fn`, the producer's PUSH end and the trainer's PULL end;
    `feed(groups)` sends groups and has the stage handle each."""
    cfg = load_config(overrides=[f"--reward.endpoint=ipc://{tmp_path}/reward.sock",
                                 f"--trainer.endpoint=ipc://{tmp_path}/trainer.sock",
                                 "--reward.metrics_port=0", "--reward.timeout_s=0.5", *overrides])
    ctx = zmq.Context()
    stage = RewardStage(cfg, ctx, reward_fn, lambda tokens: BEHAVIOUR[int(tokens[0])])
    trainer = ctx.socket(zmq.PULL)
    trainer.bind(cfg.trainer.endpoint)
    producer = ctx.socket(zmq.PUSH)
    producer.connect(cfg.reward.endpoint)

    def feed(groups):
        for g in groups:
            producer.send(encode_rollout(g))
            assert stage.pull.poll(5000, zmq.POLLIN)
            stage.handle(stage.pull.recv())
    try:
        yield stage, feed, trainer
    finally:
        stage.close()
        for sock in (trainer, producer, stage.pull, stage.push):
            sock.close(linger=0)
        ctx.term()


def test_stage_keeps_scoring_through_failures(tmp_path):
    groups = [group_of(0, [1, 2, 1, 1]), group_of(1, [3, 1, 4, 1]), group_of(2, [1, 1, 1, 5]),
              group_of(3, [1, 1, 1, 1])]
    with stage_between(tmp_path, unruly_reward) as (stage, feed, trainer):
        feed(groups)
        scored = [decode_scored(trainer.recv()) for _ in groups]
        assert [s.group.group_id for s in scored] == [g.group_id for g in groups]
        assert scored[0].rewards.tolist() == [1, 0, 1, 1]
        assert scored[1].rewards.tolist() == [0, 1, 0, 1]
        assert scored[1].reward_parts["format"].tolist() == [0, 1, 0, 1]
        assert scored[2].rewards.tolist() == [1, 1, 1, 0]
        assert scored[3].rewards.tolist() == [1, 1, 1, 1]
        assert stage.failures == {"reward_error": 2, "reward_timeout": 1, "reward_nonfinite": 1}
        registry = stage.metrics.registry
        for reason, count in stage.failures.items():
            assert registry.get_sample_value("nanomiles_reward_failures_total", {"reason": reason}) == count
        assert stage.num_sent == 4


@pytest.mark.parametrize("reward_fn", BROKEN, ids=lambda fn: fn.__name__)
def test_a_function_that_fails_on_a_whole_group_stops_the_stage(tmp_path, reward_fn):
    dotted = f"test_reward_faults:{reward_fn.__name__}"
    with stage_between(tmp_path, reward_fn, f"--reward.fn={dotted}") as (stage, feed, trainer):
        with pytest.raises(UserError) as stopped:
            feed([group_of(0, [1, 1, 1, 1])])
        assert not trainer.poll(100), "a group scored by a broken function went on to the trainer"
    assert str(stopped.value) == (f"reward.fn '{dotted}' failed on all 4 samples of a batch; the last: "
                                  f"reward_error: {BROKEN[reward_fn]}")


def test_a_function_that_fails_on_most_samples_stops_the_stage(tmp_path):
    groups = [group_of(0, [1, 2, 1, 1]), group_of(1, [2, 2, 1, 2]), group_of(2, [2, 2, 2, 1])]
    with stage_between(tmp_path, unruly_reward) as (stage, feed, trainer):
        feed(groups[:2])  # 4 of 8 failed: half, not more
        with pytest.raises(UserError, match=r"^reward.fn 'nano_miles.tasks.arithmetic:reward' failed on 7 of the 12 "
                                            r"samples scored, more than reward.max_failure_fraction = 0.5; the last: "
                                            r"reward_error: KeyError: 'no such answer'$"):
            feed(groups[2:])
        assert stage.num_sent == 2
    with stage_between(tmp_path, unruly_reward, "--reward.max_failure_fraction=1") as (stage, feed, trainer):
        feed(groups)  # 1: only a whole group stops it
        assert stage.num_sent == 3


def test_the_reward_process_exits_2_with_one_line(tmp_path):
    (tmp_path / "broken_reward.py").write_text("def reward(response, label):\n    return 'correct'\n")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("NANOMILES_")},
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO_ROOT)])}
    endpoint = f"ipc://{tmp_path}/reward.sock"
    proc = subprocess.Popen([*proc_command("reward"), f"--run.dir={tmp_path}/run", f"--reward.endpoint={endpoint}",
                             f"--trainer.endpoint=ipc://{tmp_path}/trainer.sock", "--reward.metrics_port=0",
                             "--reward.fn=broken_reward:reward"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ctx = zmq.Context()
    producer = ctx.socket(zmq.PUSH)
    producer.connect(endpoint)
    try:
        producer.send(encode_rollout(group_of(0, [5, 6, 7, 8])))
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait()
        producer.close(linger=0)
        ctx.term()
    assert proc.returncode == 2 and "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines()[-1] == ("reward: reward.fn 'broken_reward:reward' failed on all 4 samples "
                                               "of a batch; the last: reward_error: TypeError: a reward function "
                                               "returns a float or a dict of floats, not str"), stderr


def test_the_trainers_evaluation_stops_on_a_broken_function_too(engine_url, policy_dir):
    dotted = "test_reward_faults:takes_one_argument"
    cfg = load_config(overrides=[f"--reward.fn={dotted}", "--rollout.max_new_tokens=2"])
    worker = RewardWorker(takes_one_argument, timeout_s=5.0)
    evaluate = make_evaluator(cfg, [Problem("1+1=", "2"), Problem("2+3=", "5")], load_tokenizer(policy_dir), worker, [])
    try:
        with pytest.raises(UserError) as stopped:
            evaluate(EngineClient(engine_url), 0, 0.0)
    finally:
        worker.stop()
    assert str(stopped.value) == (f"reward.fn '{dotted}' failed on all 2 samples of a batch; the last: "
                                  f"reward_error: {BROKEN[takes_one_argument]}")
