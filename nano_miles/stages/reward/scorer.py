"""The reward stage: scores every sample of a group and forwards the group with its rewards.

Library module of `procs/reward.py`, the reward process supervisord starts.
A group comes from `nano_miles/stages/rollout/producer.py`: `nano_miles/wire/data.py` decodes it,
`nano_miles/rewards/worker.py` scores each sample; it goes on to `nano_miles/stages/trainer/step_loop.py`,
which turns the rewards of a whole step into advantages. The stage scores, nothing more: an estimator
that looks at the whole batch needs the trainer's view, and an algorithm change stays in one process. Stateless: a restart loses nothing it owned; groups
caught in its buffers are re-issued upstream.

The reward function runs in child workers (`nano_miles/rewards/worker.py`, `reward.num_workers` of them
scoring a group's samples at once) with `reward.timeout_s` per sample: a
sample whose function raises, hangs or returns a non-finite value gets reward 0 (parts 0), is counted
by reason and logged in one line, and the stage goes on with the next sample. A function that fails
on a whole group, or on more than `reward.max_failure_fraction` of the samples, is broken, not unlucky:
the stage stops with one line naming it and its error (a UserError: exit status 2).
"""

from __future__ import annotations

import logging
import time

import numpy as np
import zmq

from nano_miles.observe.metrics import RewardMetrics
from nano_miles.run import liveness
from nano_miles.run.config import Config
from nano_miles.rewards import describe, response_text, scored_facts
from nano_miles.rewards.worker import REASONS, FailureLimit, RewardFailure, RewardWorker, score_all
from nano_miles.wire.data import RolloutGroup, ScoredGroup, WireError, decode_rollout, encode_scored
from nano_miles.wire.sockets import make_socket

log = logging.getLogger("reward")

WAIT_SLICE_MS = 1000  # a wait for a peer beats this often: waiting is not hanging, at any hang timeout
LOG_EVERY_S = 10.0    # and says what it waits for this often


def score_group(group: RolloutGroup, worker: RewardWorker, decode, on_failure=None, facts=None) -> ScoredGroup:
    """Run the reward function on each sample's response (its model's last turn, `response_text`), the
    samples in parallel on the worker's children; `facts(group, sample)` gives what a function may ask
    for besides (`nano_miles.rewards.sample_facts`), None nothing.

    A sample that cannot be scored gets 0 in the reward and every part; `on_failure(index, failure)`
    is told about it."""
    label = str(group.metadata.get("label", ""))
    outs = score_all(worker, [(response_text(sample, decode), label, None if facts is None else facts(group, sample))
                              for sample in group.samples], on_failure)
    part_names = sorted({k for out in outs for k in out if k != "reward"})
    rewards = np.asarray([out["reward"] for out in outs], np.float32)
    parts = {k: np.asarray([out.get(k, 0.0) for out in outs], np.float32) for k in part_names}
    return ScoredGroup(group, rewards, parts)


class RewardStage:
    def __init__(self, cfg: Config, ctx: zmq.Context, reward_fn, decode, problems=()):
        self.pull = make_socket(ctx, zmq.PULL, cfg.reward.endpoint, bind=True)
        self.push = make_socket(ctx, zmq.PUSH, cfg.trainer.endpoint, bind=False)
        self.worker = RewardWorker(reward_fn, cfg.reward.timeout_s, cfg.reward.num_workers)
        self.worker.start()
        self.decode = decode
        self.cfg, self.problems = cfg, problems  # the train split: a group's prompt and record fields, by index
        self.num_received = self.num_sent = self.num_rejected = 0
        self.failures = dict.fromkeys(REASONS, 0)
        self.limit = FailureLimit(describe(cfg.reward), cfg.reward.max_failure_fraction)
        self.group_failures: list[RewardFailure] = []  # of the group being scored
        self.metrics = RewardMetrics(cfg)

    def facts(self, group: RolloutGroup, sample) -> dict:
        index = group.metadata.get("index")
        problem = self.problems[index] if isinstance(index, int) and 0 <= index < len(self.problems) else None
        return scored_facts(self.cfg, sample, self.decode, problem, takes_record=self.worker.takes_record)

    def on_failure(self, group_id: str, index: int, failure: RewardFailure) -> None:
        self.failures[failure.reason] += 1
        self.group_failures.append(failure)
        self.metrics.reward_failures.labels(failure.reason).inc()
        log.warning("%s sample %d scored 0: %s", group_id, index, failure)

    def handle(self, data: bytes) -> None:
        try:
            group = decode_rollout(data)
        except WireError as e:
            self.num_rejected += 1
            self.metrics.rejected.inc()
            log.warning("rejected a message: %s", e)
            return
        self.num_received += 1
        self.metrics.received(group)
        self.group_failures = []
        scored = score_group(group, self.worker, self.decode,
                             lambda index, failure: self.on_failure(group.group_id, index, failure), self.facts)
        self.limit.check(len(group.samples), self.group_failures)  # a broken function ends the run here
        self.send(encode_scored(scored))
        self.num_sent += 1
        self.metrics.sent(scored)

    def send(self, data: bytes) -> None:
        """PUSH blocks at its HWM while the trainer is down or busy (backpressure); say so while waiting."""
        started = logged = time.monotonic()
        while not self.push.poll(WAIT_SLICE_MS, zmq.POLLOUT):
            liveness.beat("the trainer to take a scored group")
            if time.monotonic() - logged >= LOG_EVERY_S:
                logged = time.monotonic()
                log.info("waiting for the trainer to take a scored group (%.0fs)", logged - started)
        self.push.send(data)

    def close(self) -> None:
        self.worker.stop()

    def run(self) -> None:
        log.info("scoring groups from %s", self.pull.getsockopt_string(zmq.LAST_ENDPOINT))
        logged = time.monotonic()
        while True:
            liveness.beat("rollout groups")
            if self.pull.poll(WAIT_SLICE_MS, zmq.POLLIN):
                self.handle(self.pull.recv())
                logged = time.monotonic()
            elif time.monotonic() - logged >= LOG_EVERY_S:
                logged = time.monotonic()
                log.info("idle: waiting for rollout groups (received %d, sent %d, rejected %d, "
                         "failed samples %s)", self.num_received, self.num_sent, self.num_rejected,
                         self.failures)
