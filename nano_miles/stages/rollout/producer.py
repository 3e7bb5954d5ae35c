"""The rollout producer: turns dataset prompts into `RolloutGroup`s with the engine, under a version gate.

Library module of `procs/rollout.py`, the rollout process supervisord starts.
A sample's path starts here: `ledger.py` picks the group, the rollout function (`rollout.fn`,
`nano_miles/rollouts/`) makes its samples through the engine, `nano_miles/wire/data.py` encodes it; it
goes on in `nano_miles/stages/reward/scorer.py`.

It owns the dataset cursor (in its `Ledger`) and the in-flight requests; it serves the REP end of the
control channel and PUSHes finished groups to the reward stage. Nothing is generated before the
trainer's first `resume(version)`: the trainer decides which weights serve, the producer follows.

The version gate is the whole flow control (`nano_miles/algo/admission.py`, beside the rules the
trainer admits groups by). Step k trains batch_groups groups on weights of version k - 1, so with
`version` served and `step` steps in the trainer's model, the groups on their way may not exceed
(version + 1 + max_staleness - step) * batch_groups. With max_staleness 0 (sync mode) the rollout of
step k starts only after weights k - 1 are in the engine.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import zmq

from nano_miles.algo.admission import version_allows
from nano_miles.engine.client import EngineError, is_permanent, sampling_seed
from nano_miles.engine.group import make_engine
from nano_miles.observe.metrics import RolloutMetrics
from nano_miles.rollouts import RolloutEngine, load_rollout, make_records, sample_group
from nano_miles.run import liveness
from nano_miles.run.config import Config
from nano_miles.stages.rollout.ledger import Ledger
from nano_miles.wire.control import NO_SIGNAL, ProducerStatus, RestoreState
from nano_miles.wire.data import RolloutGroup, encode_rollout
from nano_miles.wire.sockets import ControlServer, make_socket

log = logging.getLogger("rollout")

MAX_OUTBOX = 64               # finished groups held while reward does not take them (backpressure)
ENGINE_RETRY_S = (0.5, 1, 2, 4, 8)  # backoff between attempts at a group the engine failed


@dataclass
class ProducerState:
    """Counters and flags; the dataset position and leases live in the ledger."""

    version: int = -1                 # weight version the engine serves; -1 = not told yet
    step: int = 0                     # steps in the trainer's model: its last commit or restore
    is_paused: bool = True            # paused until the first resume
    num_sent: int = 0
    num_failed: int = 0               # engine failures (each retried)
    num_generated_tokens: int = 0     # the model's tokens of every group sent (goodput's denominator)
    num_resumed_samples: int = 0      # sample segments resubmitted after an abort-mode pause
    inflight: dict[str, Future] = field(default_factory=dict)


class RolloutProducer:
    def __init__(self, cfg: Config, ctx: zmq.Context, problems, prompt_ids: list[list[int]],
                 stop_token_ids: list[int], tokenizer=None):
        self.cfg = cfg
        self.records = make_records(problems, prompt_ids)
        self.rollout_fn = load_rollout(cfg.rollout)
        self.tokenizer = tokenizer  # the model's: a multi-turn rollout renders its next turns with it
        self.stop_token_ids = stop_token_ids  # the model's EOS ids and its template's end of turn
        self.state = ProducerState()
        self.ledger = Ledger(len(self.records), cfg.rollout.lease_s)
        self.engine = make_engine(cfg.engine)  # generation through the router when there is one
        self.lock = threading.Lock()  # counters written by the generate threads
        self.pool = ThreadPoolExecutor(max_workers=cfg.rollout.max_inflight_groups,
                                       thread_name_prefix="generate")
        self.push = make_socket(ctx, zmq.PUSH, cfg.reward.endpoint, bind=False,
                                hwm_msgs=cfg.rollout.max_inflight_groups)
        # Tells when the reward stage goes away: what it held is lost, so it is issued again at once.
        self.push_events = self.push.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.outbox: deque[tuple[RolloutGroup, bytes]] = deque()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)  # a full pipe already means "wake up"
        self.control = ControlServer(ctx, cfg.rollout.control_endpoint, {
            "pause": self.on_pause, "resume": self.on_resume, "status": self.on_status,
            "restore": self.on_restore, "commit": self.on_commit})
        self.max_staleness = cfg.run.effective_max_staleness
        self.metrics = RolloutMetrics(cfg, self.state)

    # ------------------------------------------------------------ control commands (idempotent)
    def on_pause(self, mode: str) -> dict:
        self.state.is_paused = True
        return self.on_status()

    def on_resume(self, version: int) -> dict:
        self.state.version = version  # the trainer may go back after a restart: it knows best
        self.state.is_paused = False
        return self.on_status()

    def on_restore(self, state: RestoreState) -> dict:
        self.ledger.restore(state.committed_group_ids, state.cursor, busy=self.generating_ids(),
                            no_signal=state.no_signal_group_ids)
        self.state.version, self.state.step = state.version, state.step
        self.state.num_generated_tokens = max(self.state.num_generated_tokens, state.num_generated_tokens)
        log.info("restored from the trainer: step %d, version %d, %d groups trained, %d to issue again",
                 state.step, state.version, len(self.ledger.trained), self.ledger.num_pending_reissue)
        return self.on_status(with_no_signal=True)  # a restarted trainer learns what it skipped, once

    def on_commit(self, step: int, group_ids: list[str], dropped_attempts: dict[str, int],
                  no_signal_group_ids: list[str]) -> dict:
        self.state.step = step  # the trainer may go back after a restart: it knows best
        self.ledger.on_trained(group_ids)
        self.ledger.on_dropped(dropped_attempts)
        for group_id in no_signal_group_ids:  # consumed by the trainer: out of the run, with why
            self.ledger.on_dropped_for_good(group_id, NO_SIGNAL)
            self.metrics.dropped_for_good.labels(NO_SIGNAL).inc()
        return self.on_status()

    def on_status(self, *, with_no_signal: bool = False) -> dict:
        s = self.state
        if s.is_paused:
            waiting = "the trainer's resume"
        elif self.outbox:
            waiting = f"the reward stage to take {len(self.outbox)} finished groups"
        elif s.inflight:
            waiting = f"engine replies for {len(s.inflight)} groups"
        else:
            waiting = f"weights newer than version {s.version} (the version gate)"
        return ProducerStatus(
            version=s.version, is_paused=s.is_paused, waiting_for=waiting, num_sent=s.num_sent,
            num_generated_tokens=s.num_generated_tokens, num_resumed_samples=s.num_resumed_samples,
            num_failed=s.num_failed, num_reissued=self.ledger.num_reissued, num_inflight=len(s.inflight),
            outstanding_group_ids=sorted(self.ledger.outstanding),
            dropped_for_good={g: why for g, why in self.ledger.dropped_for_good.items()
                              if with_no_signal or why != NO_SIGNAL},
        ).to_result()

    def generating_ids(self) -> set[str]:
        """Groups still here: being generated or waiting in the outbox for the reward stage."""
        return set(self.state.inflight) | {group.group_id for group, _ in self.outbox}

    # ------------------------------------------------------------ generation
    def issue(self) -> None:
        group_id, index, attempt = self.ledger.next_group()
        self.metrics.issued()
        fut = self.pool.submit(self.generate_group, group_id, index, attempt)
        fut.add_done_callback(lambda _: os.write(self.wake_w, b"."))  # wake the loop at once
        self.state.inflight[group_id] = fut

    def generate_group(self, group_id: str, index: int, attempt: int = 0) -> RolloutGroup:
        """The group's samples from the rollout function (`rollout.fn`), through an engine adapter that
        retries a failing engine and resumes whatever a weight update cut (`nano_miles/rollouts/engine.py`)."""
        r = self.cfg.rollout
        started = time.time()
        engine = RolloutEngine(
            self.generate_with_retry, group_size=r.group_size, max_new_tokens=r.max_new_tokens,
            sampling={"temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k},
            stop_token_ids=self.stop_token_ids, tokenizer=self.tokenizer, max_turns=r.max_turns,
            on_resumed=self.count_resumed,
            # a sample's draws are a function of what it is (run seed, group, attempt, sample, request);
            # through a router a fresh group goes as one request without them (engine/group.py)
            seed_of=lambda sample, n: sampling_seed(self.cfg.run.seed, group_id, attempt, sample, n))
        record = self.records[index]
        samples = sample_group(self.rollout_fn, record, engine)
        return RolloutGroup(group_id, attempt, np.asarray(record.prompt_ids, np.int32), samples,
                            metadata={"label": record.label, "index": index},
                            timestamps={"issued": started, "generated": time.time()}, run_id=self.control.run_id)

    def count_resumed(self, num: int) -> None:
        with self.lock:
            self.state.num_resumed_samples += num

    def generate_with_retry(self, input_ids: list[list[int]], params: list[dict]) -> list[dict]:
        """/generate, retried with backoff while the engine is down or failing (never dropped).

        After a failure the request waits until the engine serves the expected weights again: a
        restarted engine comes back with base weights, and the trainer re-pushes the current ones.
        """
        for delay_s in (*ENGINE_RETRY_S, None):
            try:
                return self.engine.generate(input_ids, params)
            except (EngineError, OSError) as e:
                with self.lock:
                    self.state.num_failed += 1
                self.metrics.engine_failures.inc()
                if delay_s is None or is_permanent(e):
                    raise
                log.warning("engine failed a request (%s); retrying in %.1fs", e, delay_s)
                time.sleep(delay_s)
                self.wait_for_engine_version()
        raise AssertionError("unreachable")

    def wait_for_engine_version(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                served = self.engine.weight_version()
                if served is not None and served >= self.state.version:
                    return
            except (EngineError, OSError):
                pass
            time.sleep(0.5)
        log.warning("engine at %s still not serving version %d after %.0fs", self.cfg.engine.url,
                    self.state.version, timeout_s)

    # ------------------------------------------------------------ the loop
    def collect(self) -> None:
        for group_id, fut in list(self.state.inflight.items()):
            if not fut.done():
                continue
            del self.state.inflight[group_id]
            try:
                group = fut.result()
            except (EngineError, OSError, ValueError) as e:
                if is_permanent(e):  # retrying cannot help: out of the run, reported with the reason
                    reason = f"engine_http_{e.status}"
                    log.warning("group %s dropped for good (%s): %s", group_id, reason, e.message[:200])
                    self.ledger.on_dropped_for_good(group_id, reason)
                    self.metrics.dropped_for_good.labels(reason).inc()
                    continue
                # the engine failed this group after every retry: it goes back in line, nothing is lost
                log.warning("group %s failed (%s); it will be issued again", group_id, e)
                self.ledger.on_dropped({group_id: self.ledger.attempts[group_id]})
                continue
            self.outbox.append((group, encode_rollout(group)))
            self.state.num_generated_tokens += sum(s.num_model_tokens for s in group.samples)

    def flush_outbox(self) -> None:
        """Hand finished groups to reward without ever blocking the control loop."""
        while self.outbox:
            group, data = self.outbox[0]
            try:
                self.push.send(data, zmq.NOBLOCK)
            except zmq.Again:
                return
            self.outbox.popleft()
            self.ledger.renew(group.group_id)
            self.state.num_sent += 1
            self.metrics.sent(group)

    def on_downstream_lost(self) -> None:
        """The reward stage's connection closed (it died or restarted): the groups it held are gone."""
        while self.push_events.poll(0):
            self.push_events.recv_multipart()  # the event frames; only their arrival matters
        released = self.ledger.release(busy=self.generating_ids())
        log.warning("the reward stage went away; issuing again the %d groups sent downstream and not trained yet",
                    len(released))

    def may_issue(self) -> bool:
        s = self.state
        # nothing before a trainer's `restore` has claimed this producer for its run
        return (not s.is_paused and self.control.run_id is not None
                and len(s.inflight) < self.cfg.rollout.max_inflight_groups
                and len(self.outbox) < MAX_OUTBOX
                and version_allows(len(self.ledger.outstanding), s.version, s.step,
                                   self.cfg.trainer.batch_groups, self.max_staleness))

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.push.disable_monitor()
        for sock in (self.push_events, self.push):
            sock.close(linger=0)
        self.control.close()

    def run(self, *, poll_s: float = 0.05) -> None:
        """The loop: answer control, hand on finished groups, expire leases, issue under the gate.

        It sleeps in one poll on the control socket and a self-pipe that every finished generation
        writes to, so a finished group moves on at once, without a polling delay."""
        log.info("serving control on %s; waiting for the trainer's resume", self.cfg.rollout.control_endpoint)
        poller = zmq.Poller()
        poller.register(self.control.sock, zmq.POLLIN)
        poller.register(self.wake_r, zmq.POLLIN)
        poller.register(self.push_events, zmq.POLLIN)
        next_expiry_s = 0.0
        while True:
            liveness.beat()
            events = dict(poller.poll(int(poll_s * 1000)))
            if self.wake_r in events:
                os.read(self.wake_r, 4096)
            if self.control.sock in events:
                self.control.poll_once(0)
            if self.push_events in events:
                self.on_downstream_lost()
            self.collect()
            self.flush_outbox()
            now = time.monotonic()
            if now >= next_expiry_s and not self.outbox:  # while reward is stuck, leases wait too
                expired = self.ledger.expire(now, busy=set(self.state.inflight))
                if expired:
                    log.warning("lease expired for %d groups (lost downstream?); issuing them again: %s",
                                len(expired), ", ".join(expired[:8]))
                next_expiry_s = now + 1.0
            while self.may_issue():
                self.issue()
