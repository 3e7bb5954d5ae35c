"""The reward stage: scores every sample of a group, computes group advantages, forwards the group.

Run under supervisord as `python procs/reward.py [--section.key=value ...]`. Stateless: a restart
loses nothing it owned; groups caught in its buffers are re-issued upstream.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch
import zmq

from nano_miles.channels import make_socket
from nano_miles.config import Config
from nano_miles.grpo import group_advantages
from nano_miles.metrics import RewardMetrics
from nano_miles.wire import RolloutGroup, ScoredGroup, WireError, decode_rollout, encode_scored

log = logging.getLogger("reward")


def score_group(group: RolloutGroup, reward_fn, decode) -> ScoredGroup:
    """Run the reward function on each decoded response; whiten rewards inside the group."""
    label = str(group.metadata.get("label", ""))
    parts: dict[str, list[float]] = {}
    rewards = []
    for sample in group.samples:
        out = reward_fn(decode(sample.response_tokens), label)
        total = float(out["reward"])
        if not math.isfinite(total):
            raise ValueError(f"reward function returned a non-finite reward {total}")
        rewards.append(total)
        for name, value in out.items():
            if name != "reward":
                parts.setdefault(name, []).append(float(value))
    rewards_arr = np.asarray(rewards, np.float32)
    advantages = group_advantages(torch.from_numpy(rewards_arr)[None, :])[0].numpy()
    return ScoredGroup(group, rewards_arr, advantages.astype(np.float32),
                       {k: np.asarray(v, np.float32) for k, v in parts.items()})


class RewardStage:
    def __init__(self, cfg: Config, ctx: zmq.Context, reward_fn, decode):
        self.pull = make_socket(ctx, zmq.PULL, cfg.reward.endpoint, bind=True)
        self.push = make_socket(ctx, zmq.PUSH, cfg.trainer.endpoint, bind=False)
        self.reward_fn, self.decode = reward_fn, decode
        self.num_received = self.num_sent = self.num_rejected = 0
        self.metrics = RewardMetrics(cfg)

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
        scored = score_group(group, self.reward_fn, self.decode)
        self.push.send(encode_scored(scored))
        self.num_sent += 1
        self.metrics.sent(scored)

    def run(self) -> None:
        log.info("scoring groups from %s", self.pull.getsockopt_string(zmq.LAST_ENDPOINT))
        while True:
            if self.pull.poll(10_000, zmq.POLLIN):
                self.handle(self.pull.recv())
            else:
                log.info("idle: waiting for rollout groups (received %d, sent %d)",
                         self.num_received, self.num_sent)
