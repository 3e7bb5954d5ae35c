"""The rollout producer: turns dataset prompts into `RolloutGroup`s with the engine, under a version gate.

Run under supervisord as `python procs/rollout.py [--section.key=value ...]`.

It owns the dataset cursor and the in-flight requests; it serves the REP end of the control channel
and PUSHes finished groups to the reward stage. Nothing is generated before the trainer's first
`resume(version)`: the trainer decides which weights serve, the producer only follows.

The version gate is the whole flow control. Group number n (counting from 0 in issue order) feeds
training step n // batch_groups + 1, which trains on weights of version (that step - 1); so it may
start only once the engine serves version >= n // batch_groups - max_staleness. With max_staleness 0
(sync mode) the rollout of step k starts only after weights k - 1 are in the engine.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import zmq

from nano_miles.channels import ControlServer, make_socket
from nano_miles.config import Config
from nano_miles.engine_client import EngineClient, EngineError, parse_output
from nano_miles.metrics import RolloutMetrics
from nano_miles.wire import RolloutGroup, Sample, encode_rollout, make_group_id

log = logging.getLogger("rollout")


@dataclass
class ProducerState:
    """What the producer knows; all of it can be rebuilt from the trainer with `sync`."""

    version: int = -1                 # weight version the engine serves; -1 = not told yet
    is_paused: bool = True            # paused until the first resume
    num_issued: int = 0               # groups issued so far (drives the version gate)
    epoch: int = 0
    index: int = 0                    # next dataset index to issue
    num_sent: int = 0
    num_failed: int = 0
    inflight: dict[str, Future] = field(default_factory=dict)


def version_allows(num_issued: int, version: int, batch_groups: int, max_staleness: int) -> bool:
    """May group number `num_issued` start while the engine serves `version`? (see module doc)"""
    return version >= num_issued // batch_groups - max_staleness


class RolloutProducer:
    def __init__(self, cfg: Config, ctx: zmq.Context, problems, prompt_ids: list[list[int]]):
        self.cfg = cfg
        self.problems = problems
        self.prompt_ids = prompt_ids
        self.state = ProducerState()
        self.engine = EngineClient(cfg.engine.url, timeout_s=cfg.engine.request_timeout_s)
        self.pool = ThreadPoolExecutor(max_workers=cfg.rollout.max_inflight_groups,
                                       thread_name_prefix="generate")
        self.push = make_socket(ctx, zmq.PUSH, cfg.reward.endpoint, bind=False)
        self.control = ControlServer(ctx, cfg.rollout.control_endpoint, {
            "pause": self.on_pause, "resume": self.on_resume, "status": self.on_status,
            "sync": self.on_sync, "commit": self.on_commit})
        self.max_staleness = cfg.run.max_staleness if cfg.run.mode == "async" else 0
        self.metrics = RolloutMetrics(cfg, self.state)

    # ------------------------------------------------------------ control commands (idempotent)
    def on_pause(self, mode: str) -> dict:
        self.state.is_paused = True
        return {"num_inflight": len(self.state.inflight)}

    def on_resume(self, version: int) -> dict:
        self.state.version = max(self.state.version, version)
        self.state.is_paused = False
        return {"version": self.state.version}

    def on_sync(self, state: dict) -> dict:
        s = self.state
        s.version, s.num_issued = state["version"], state["step"] * self.cfg.trainer.batch_groups
        s.epoch, s.index = state["data_cursor"]["epoch"], state["data_cursor"]["index"]
        return {"num_issued": s.num_issued}

    def on_commit(self, step: int, group_ids: list[str]) -> dict:
        return {"step": step}

    def on_status(self) -> dict:
        s = self.state
        waiting = ("trainer's resume" if s.is_paused else
                   "engine replies" if s.inflight else f"weights of a newer version than {s.version}")
        return {"version": s.version, "is_paused": s.is_paused, "num_issued": s.num_issued,
                "num_inflight": len(s.inflight), "num_sent": s.num_sent, "waiting_for": waiting}

    # ------------------------------------------------------------ generation
    def next_item(self) -> tuple[str, int]:
        s = self.state
        if s.index >= len(self.problems):
            s.epoch, s.index = s.epoch + 1, 0
        item = (make_group_id(s.epoch, s.index), s.index)
        s.index += 1
        return item

    def issue(self) -> None:
        group_id, index = self.next_item()
        self.state.num_issued += 1
        self.metrics.issued()
        self.state.inflight[group_id] = self.pool.submit(self.generate_group, group_id, index)

    def generate_group(self, group_id: str, index: int) -> RolloutGroup:
        r = self.cfg.rollout
        prompt = self.prompt_ids[index]
        started = time.time()
        params = {"max_new_tokens": r.max_new_tokens, "temperature": r.temperature,
                  "top_p": r.top_p, "top_k": r.top_k}
        outputs = self.engine.generate([prompt] * r.group_size, params, return_logprob=True)
        samples = []
        for out in outputs:
            tokens, logprobs, finish, version = parse_output(out["meta_info"], out["output_ids"])
            samples.append(Sample(np.asarray(tokens, np.int32), np.asarray(logprobs, np.float32),
                                  np.full(len(tokens), int(version), np.int32), finish))
        return RolloutGroup(group_id, 0, np.asarray(prompt, np.int32), samples,
                            metadata={"label": self.problems[index].answer, "index": index},
                            timestamps={"issued": started, "generated": time.time()})

    def collect(self) -> None:
        for group_id, fut in list(self.state.inflight.items()):
            if not fut.done():
                continue
            del self.state.inflight[group_id]
            try:
                group = fut.result()
            except (EngineError, OSError, ValueError) as e:
                # the engine failed this group: issue the same prompt again rather than lose it
                self.state.num_failed += 1
                self.metrics.engine_failures.inc()
                log.warning("group %s failed (%s); re-issuing", group_id, e)
                index = int(group_id.split("-i")[1])
                self.state.inflight[group_id] = self.pool.submit(self.generate_group, group_id, index)
                continue
            self.push.send(encode_rollout(group))
            self.state.num_sent += 1
            self.metrics.sent(group)

    def run(self, *, poll_s: float = 0.01) -> None:
        s, r = self.state, self.cfg.rollout
        log.info("serving control on %s; waiting for the trainer's resume", self.cfg.rollout.control_endpoint)
        while True:
            self.control.poll_once(poll_s)
            self.collect()
            while (not s.is_paused and len(s.inflight) < r.max_inflight_groups
                   and version_allows(s.num_issued, s.version, self.cfg.trainer.batch_groups,
                                      self.max_staleness)):
                self.issue()
