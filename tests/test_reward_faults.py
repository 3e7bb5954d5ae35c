"""A reward function that raises, hangs or returns NaN costs one sample, never the reward stage.

Run: `pytest tests/test_reward_faults.py`. A real RewardStage on ipc:// sockets, fed real rollout
messages; the misbehaving reward functions are defined here.
"""

import os
import time

import numpy as np
import zmq

from nano_miles.run.config import load_config
from nano_miles.stages.reward.scorer import RewardStage
from nano_miles.rewards.worker import RewardFailure, RewardWorker
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


def test_stage_keeps_scoring_through_failures(tmp_path):
    cfg = load_config(overrides=[f"--reward.endpoint=ipc://{tmp_path}/reward.sock",
                                 f"--trainer.endpoint=ipc://{tmp_path}/trainer.sock",
                                 "--reward.metrics_port=0", "--reward.timeout_s=0.5"])
    ctx = zmq.Context()
    decode = lambda tokens: BEHAVIOUR[int(tokens[0])]
    stage = RewardStage(cfg, ctx, unruly_reward, decode)
    trainer = ctx.socket(zmq.PULL)
    trainer.bind(cfg.trainer.endpoint)
    producer = ctx.socket(zmq.PUSH)
    producer.connect(cfg.reward.endpoint)
    groups = [group_of(0, [1, 2, 1, 1]), group_of(1, [3, 1, 4, 1]), group_of(2, [1, 1, 1, 5]),
              group_of(3, [1, 1, 1, 1])]
    for g in groups:
        producer.send(encode_rollout(g))
    for _ in groups:
        assert stage.pull.poll(5000, zmq.POLLIN)
        stage.handle(stage.pull.recv())
    try:
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
    finally:
        stage.close()
        for sock in (trainer, producer, stage.pull, stage.push):
            sock.close(linger=0)
        ctx.term()
